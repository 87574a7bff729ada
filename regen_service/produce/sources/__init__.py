"""Input formats: one normalizer per `SourceSpec.format`, all producing schemas.PromptRecord.

`normalize_row(source_spec, raw, row_index)` is the one entry point: it applies the source's field
renames, runs the format's normalizer, computes the content-hash prompt id and returns a PromptRecord,
or raises `RowError` with a human reason (the producer quarantines the row; a row never crashes it).
`read_rows` (reader.py) yields a source's raw rows. Sampling, dedup and sharding live in
regen_service.produce.prepare; see docs/sources.md for every normalization rule.
"""

from __future__ import annotations

from collections.abc import Callable

from regen_service.produce.sources import instruction, messages, pretokenized, prompt_response, sharegpt
from regen_service.produce.sources.base import Fields, Normalized, RowError
from regen_service.produce.sources.images import ImageReader
from regen_service.produce.sources.reader import BadRow, read_rows
from schemas.conversation import PromptRecord, compute_prompt_id
from schemas.mix import SourceSpec

NORMALIZERS: dict[str, Callable[[dict, Fields], Normalized]] = {
    "sharegpt": sharegpt.normalize,
    "messages": messages.normalize,
    "instruction": instruction.normalize,
    "prompt_response": prompt_response.normalize,
    "pretokenized": pretokenized.normalize,
}


# The formats whose content can hold image parts (the others carry plain strings or token ids).
IMAGE_FORMATS = ("sharegpt", "messages")


def normalize(
    source_spec: SourceSpec, raw: dict, fields: Fields | None = None, images: ImageReader | None = None
) -> Normalized:
    """The format's normalizer on one row; RowError for anything it cannot use. With `images`, image
    parts are read and checked (images.py); without, they are dropped and counted."""
    if not isinstance(raw, dict):
        kind = "null" if raw is None else type(raw).__name__
        raise RowError(f"row: expected an object, got {kind}")
    fn = NORMALIZERS[source_spec.format]
    try:
        if source_spec.format in IMAGE_FORMATS:
            return fn(raw, fields or Fields(source_spec.fields), images)
        return fn(raw, fields or Fields(source_spec.fields))
    except RowError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        # A shape no check above anticipated: still the row's fault, never the producer's crash.
        raise RowError(
            f"row: could not be normalized as {source_spec.format} ({type(err).__name__}: {err})"
        ) from None


def prompt_id_of(n: Normalized) -> str:
    return compute_prompt_id(n.conversation, n.input_ids)


def normalize_row(source_spec: SourceSpec, raw: dict, row_index: int) -> PromptRecord:
    """One raw row of `source_spec` as a PromptRecord (prompt id from content only), or RowError."""
    n = normalize(source_spec, raw)
    return PromptRecord(
        prompt_id=prompt_id_of(n),
        source=source_spec.name,
        row_index=row_index,
        conversation=n.conversation,
        input_ids=n.input_ids,
        loss_mask=n.loss_mask,
        num_dropped_parts=n.num_dropped_parts,
    )


__all__ = [
    "NORMALIZERS",
    "BadRow",
    "Fields",
    "ImageReader",
    "Normalized",
    "RowError",
    "normalize",
    "normalize_row",
    "prompt_id_of",
    "read_rows",
]
