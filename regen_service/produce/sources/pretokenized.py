"""Pretokenized rows: `input_ids` and `loss_mask`, lists of ints of equal length, passed through.

These rows were produced by the target already (its chat template, its tokens); the worker writes
them to the output unchanged, so the only job here is to refuse what would break the output schema:
non-int ids (bools and floats included), ids outside int32, masks other than 0/1, unequal lengths.
"""

from __future__ import annotations

from regen_service.produce.sources.base import Fields, Normalized, RowError, type_name

INT32_MAX = 2**31 - 1


def _int_list(value, where: str) -> list[int]:
    if value is None:
        raise RowError(f"{where}: missing; a pretokenized row needs input_ids and loss_mask")
    if hasattr(value, "tolist") and not isinstance(value, list):  # numpy arrays from some readers
        value = value.tolist()
    if not isinstance(value, list):
        raise RowError(f"{where}: expected a list of ints, got {type_name(value)}")
    for i, v in enumerate(value):
        if type(v) is not int:
            raise RowError(f"{where}[{i}]: expected an int, got {type_name(v)} {v!r}")
    return value


def normalize(raw: dict, fields: Fields) -> Normalized:
    k_ids, k_mask = fields("input_ids"), fields("loss_mask")
    ids = _int_list(raw.get(k_ids), k_ids)
    mask = _int_list(raw.get(k_mask), k_mask)
    if not ids:
        raise RowError(f"{k_ids}: empty; a pretokenized row needs at least one token")
    if len(ids) != len(mask):
        raise RowError(
            f"{k_mask}: length {len(mask)} differs from {k_ids} length {len(ids)}; they must match"
        )
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi > INT32_MAX:
        bad = lo if lo < 0 else hi
        raise RowError(f"{k_ids}: token id {bad} out of range (0..{INT32_MAX})")
    if any(m not in (0, 1) for m in mask):
        raise RowError(f"{k_mask}: values must be 0 or 1")
    return Normalized(None, input_ids=ids, loss_mask=mask)
