"""How a product over many rows is cut into chunks: equal ones, within an element budget.

The target's head (target_head.py) and the draft's head with its loss (loss.py) each make [rows, vocab]
logits a chunk at a time, so that no whole [rows, vocab] tensor is ever alive. Both cut the rows the same
way: as few chunks as the budget allows, all of one size (the last smaller by less than one chunk's
count), so the peak is the budget's at most, and no short last chunk runs a thin GEMM. Pure arithmetic.
"""

from __future__ import annotations


def chunk_rows(n: int, width: int, budget_elems: int) -> int:
    """Rows a chunk: n rows of `width` elements each split into ceil(n / most) chunks of equal size,
    most the rows `budget_elems` allows at this width (at least one)."""
    most = max(1, budget_elems // width)
    if n == 0:
        return most
    chunks = -(-n // most)
    return -(-n // chunks)
