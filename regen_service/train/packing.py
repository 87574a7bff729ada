"""Sequence packing: several samples in one row of `max_length` tokens, each attending only to itself.

With `data.packing: true` a training batch is `batch_size` rows of max_length tokens, each row
filled with whole samples in their shuffled order (`pack`: first fit over the rows still open), so
every step has one shape (one compile, the memory the fit check measured) and almost no padding,
where length buckets pad a batch of one 3K answer to 3,072 and compile ~24 shapes. speculators packs
the same way (src/speculators/train/data.py at c05b95b: rows of max_len with `document_ids`, pads -1).

What keeps a packed row equal to its samples trained apart (tests/train/test_packing.py holds the loss
and every gradient to the padded batch's):
- attention: each query sees the keys of its own document only (`Documents.segments` for the flash
  kernels, run once per document; `doc_ids` for the eager and flex masks; layers.attend, flash_ttt);
- rotary positions restart at each document (`positions`), as the target saw them;
- training-time test: step i at position t reads token t+1+i and learns from t+2+i, which past a
  document's end belong to the next document; those positions count in no loss (ttt.ttt_loss). speculators
  lets them through (its teacher-forced shift runs over the whole row);
- the target never sees two documents in one sequence: `packed_states` asks the target backend for
  each sample's states, in groups of similar length, and lays them side by side.
A sample with images is a row of its own: its length is the engine's expansion, known only once the
engine has answered. Which shards to read and when is loop.py's. Imports torch only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# rows still open to first fit: older rows are closed, so packing a shard is O(samples x OPEN_ROWS)
OPEN_ROWS = 64


@dataclass(frozen=True)
class Documents:
    """The documents of a packed batch: per row, the token counts of its samples in order. The padding
    after a row's last sample is a segment of its own (it attends to itself, counts in no loss)."""

    lengths: tuple[tuple[int, ...], ...]
    row_len: int

    def __post_init__(self) -> None:
        for r, row in enumerate(self.lengths):
            if any(n < 1 for n in row) or sum(row) > self.row_len:
                raise ValueError(f"row {r}: document lengths {row} do not fit a row of {self.row_len} tokens")

    @property
    def segments(self) -> tuple[tuple[int, int, int], ...]:
        """(row, start, end) of every document and of each row's trailing padding, in row order."""
        out = []
        for r, row in enumerate(self.lengths):
            s = 0
            for n in row:
                out.append((r, s, s + n))
                s += n
            if s < self.row_len:
                out.append((r, s, self.row_len))
        return tuple(out)

    def doc_ids(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[B, T] int64: 1 + the segment's index in its row (0 never occurs: shifted-in zeros match nothing)."""
        ids = torch.zeros(len(self.lengths), self.row_len, dtype=torch.int64)
        k, last = 0, -1
        for r, s, e in self.segments:
            k = k + 1 if r == last else 1
            ids[r, s:e], last = k, r
        return ids.to(device)

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[B, T] int64: each token's position inside its document (the rotary position the target used)."""
        pos = torch.zeros(len(self.lengths), self.row_len, dtype=torch.int64)
        for r, s, e in self.segments:
            pos[r, s:e] = torch.arange(e - s)
        return pos.to(device)

    @property
    def num_docs(self) -> int:
        return sum(len(row) for row in self.lengths)


def _length(ex) -> int:
    return int(ex.ids.numel())


def pack(examples: Sequence, row_len: int) -> list[list]:
    """The examples in rows of at most row_len tokens, each example in the first open row with room for it
    (in the order given: the shuffle's); a sample with images (`vl`) is a row of its own. Every example is
    in exactly one row; rows come in the order they were opened."""
    alone = [getattr(ex, "vl", None) is not None for ex in examples]
    return [
        [examples[i] for i in row] for row in pack_lengths([_length(ex) for ex in examples], row_len, alone)
    ]


def pack_lengths(
    lengths: Sequence[int], row_len: int, alone: Sequence[bool] | None = None
) -> list[list[int]]:
    """`pack` on lengths: rows of indices into `lengths`; `alone[i]`: index i gets a row of its own."""
    rows: list[list[int]] = []
    open_rows: list[tuple[int, int]] = []  # (row index, free tokens)
    for i, n in enumerate(lengths):
        if n > row_len:
            raise ValueError(
                f"a sample of {n} tokens is longer than the packed row ({row_len}); cut it first"
            )
        if alone is not None and alone[i]:
            rows.append([i])
            continue
        for j, (r, free) in enumerate(open_rows):
            if free >= n:
                rows[r].append(i)
                open_rows[j] = (r, free - n)
                break
        else:
            rows.append([i])
            open_rows.append((len(rows) - 1, row_len - n))
            if len(open_rows) > OPEN_ROWS:
                open_rows.pop(0)
        open_rows = [(r, free) for r, free in open_rows if free > 0]
    return rows


def _groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices in groups whose padded size (count x longest) stays within budget tokens, longest first:
    the target runs each group as one padded batch."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def packed_states(target, rows: list[list], draft_token_ids: torch.Tensor | None, row_len: int):
    """Packed rows -> (batch, aux, greedy next token, draft-vocab logits, Documents), as
    TargetBackend.example_states returns them for padded batches, each sample's states computed on that
    sample alone. Rows are row_len tokens, or the longest row where a sample with images expanded past it."""
    docs = [ex for row in rows for ex in row]
    per: list = [None] * len(docs)
    for group in _groups([_length(ex) for ex in docs], len(rows) * row_len):
        batch, aux, pred, logits = target.example_states([docs[i] for i in group], draft_token_ids)
        n = batch["attention_mask"].sum(1).tolist()
        for j, i in enumerate(group):
            k = int(n[j])
            per[i] = (
                batch["input_ids"][j, :k],
                batch["loss_mask"][j, :k],
                aux[j, :k],
                pred[j, :k],
                None if logits is None else logits[j, :k],
            )
    lengths, i = [], 0
    for row in rows:
        lengths.append(tuple(int(per[i + j][0].numel()) for j in range(len(row))))
        i += len(row)
    t = max(row_len, *(sum(row) for row in lengths))
    first = per[0]
    b = len(rows)
    ids = torch.zeros(b, t, dtype=first[0].dtype)
    mask = torch.zeros(b, t, dtype=first[1].dtype)
    attn = torch.zeros(b, t, dtype=torch.int64)
    aux = first[2].new_zeros(b, t, first[2].shape[-1])
    pred = first[3].new_zeros(b, t)
    logits = None if first[4] is None else first[4].new_zeros(b, t, first[4].shape[-1])
    i = 0
    for r, row in enumerate(lengths):
        s = 0
        for n in row:
            d_ids, d_mask, d_aux, d_pred, d_logits = per[i]
            ids[r, s : s + n], mask[r, s : s + n], attn[r, s : s + n] = d_ids, d_mask, 1
            aux[r, s : s + n], pred[r, s : s + n] = d_aux, d_pred
            if logits is not None:
                logits[r, s : s + n] = d_logits
            s, i = s + n, i + 1
    batch = {"input_ids": ids, "loss_mask": mask, "attention_mask": attn}
    return batch, aux, pred, logits, Documents(tuple(lengths), t)


def global_batch_docs(rows: list[list], batch_size: int, world: int, b: int) -> int:
    """Samples in global step b when `rows` are split rank::world and batched (data.rank_batches' split):
    the progress count of a packed step, which holds more samples than it has rows."""
    total = 0
    for r in range(world):
        mine = rows[r::world][b * batch_size : (b + 1) * batch_size]
        total += sum(len(row) for row in mine)
    return total
