"""The typed rows of an output shard: `OutputRow` (OUTPUT_SCHEMA) and its `Turn`s (TURN).

The Regenerator builds OutputRows, the reuse copier and the shard log read them back, the progress
counters, metrics and the trainer read their attributes. `to_record`/`from_record` convert one row
to and from the plain dict pyarrow takes (and the shard log's JSON lines hold); `output_table` and
`output_rows` convert a list of rows to and from a pyarrow Table with OUTPUT_SCHEMA. The dataclass
fields are OUTPUT_SCHEMA's columns in order (checked at import), so the Parquet bytes are those the
untyped dicts produced. Prompt rows are schemas.conversation.PromptRecord; what to write where is
the service's business.

Image parts live on the messages (Message.images), as in prompt rows; `to_record` writes them as the
`images` column (OUTPUT_SCHEMA_IMAGES, schema version 2: refs, never bytes) and `from_record` puts
them back on the messages, so a row read back holds the images its prompt held.

Every column of OUTPUT_SCHEMA is nullable and readers select subsets of columns (the trainer reads
six), so every field defaults to None: a column not read reads as None, like a null.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields

import pyarrow as pa

from schemas.conversation import Message, image_parts, with_image_parts
from schemas.tables import OUTPUT_SCHEMA, OUTPUT_SCHEMA_IMAGES, TURN


@dataclass(slots=True)
class Turn:
    """One regenerated assistant turn: what the server returned for it, unchanged (TURN's columns)."""

    message_index: int | None = None  # index of this assistant turn in the row's messages
    text: str | None = None  # raw text as generated (thinking included when the server sent it)
    output_ids: list[int] | None = None  # api generate: the server's output_ids, as sent
    finish_reason: str | None = None  # stop | length | tool_calls | abort
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    decode_tok_s: float | None = None
    latency_s: float | None = None
    endpoint: str | None = None
    attempts: int | None = None
    # api generate: the exact prompt this turn was generated from; ids null when they are a prefix of
    # the row's input_ids (see TURN), both null in rows written before they were stored.
    prompt_len: int | None = None
    prompt_ids: list[int] | None = None

    @classmethod
    def from_record(cls, d: dict) -> Turn:
        return cls(**{f: d.get(f) for f in _TURN_FIELDS})


@dataclass(slots=True)
class OutputRow:
    """One row of an output shard (OUTPUT_SCHEMA); what each column means is documented there."""

    run_id: str | None = None
    prompt_id: str | None = None
    source: str | None = None
    row_index: int | None = None
    messages: tuple[Message, ...] | None = None  # the regenerated conversation; None: pretokenized
    tools: str | None = None  # JSON list of OpenAI function schemas
    turns: list[Turn] | None = None
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    endpoint: str | None = None
    model: str | None = None
    api: str | None = None
    sampling_hash: str | None = None
    regen_key: str | None = None
    attempts: int | None = None
    latency_s: float | None = None
    ttft_s: float | None = None
    decode_tok_s: float | None = None
    error: str | None = None  # None when the row was answered
    error_class: str | None = None  # terminal_row | terminal_endpoint | retries_exhausted
    reused_from: str | None = None  # run id the answer was reused from

    def to_record(self) -> dict:
        """The plain dict of this row, OUTPUT_SCHEMA's column names, messages in their "arrow" form."""
        d = {f: getattr(self, f) for f in _ROW_FIELDS}
        if self.messages is not None:
            d["messages"] = [m.to_dict("arrow") for m in self.messages]
            if parts := image_parts(self.messages):  # only then: a text row's record is what it was
                d["images"] = parts
        if self.turns is not None:
            d["turns"] = [asdict(t) for t in self.turns]
        return d

    @classmethod
    def from_record(cls, d: dict) -> OutputRow:
        """A row from a dict of some or all of OUTPUT_SCHEMA's columns (a Parquet row, a JSON line)."""
        row = cls(**{f: d.get(f) for f in _ROW_FIELDS})
        if row.messages is not None:
            messages = [Message.from_dict(m) for m in row.messages]
            row.messages = tuple(with_image_parts(messages, d.get("images")))
        if row.turns is not None:
            row.turns = [Turn.from_record(t) for t in row.turns]
        return row


_ROW_FIELDS = tuple(f.name for f in fields(OutputRow))
_TURN_FIELDS = tuple(f.name for f in fields(Turn))
# The dataclasses are the schemas' columns, in order: a column added to one and not the other would
# silently read as None or be dropped on write.
# (`images` is no field: it is the messages' image parts, OUTPUT_SCHEMA_IMAGES's last column.)
_COLUMNS = (tuple(OUTPUT_SCHEMA.names), tuple(f.name for f in TURN))
if (_ROW_FIELDS, _TURN_FIELDS) != _COLUMNS or OUTPUT_SCHEMA_IMAGES.names != [*OUTPUT_SCHEMA.names, "images"]:
    raise TypeError("schemas.rows: OutputRow/Turn fields differ from OUTPUT_SCHEMA/TURN's columns")


def output_table(rows: Iterable[OutputRow], *, images: bool = False) -> pa.Table:
    """The rows as a pyarrow Table with OUTPUT_SCHEMA (its metadata included), or OUTPUT_SCHEMA_IMAGES
    (version 2) when `images` (the run's prompts hold images) or any row has an image part; pyarrow
    ignores the records' `images` key under OUTPUT_SCHEMA."""
    records = [r.to_record() for r in rows]
    with_images = images or any(r.get("images") for r in records)
    return pa.Table.from_pylist(records, schema=OUTPUT_SCHEMA_IMAGES if with_images else OUTPUT_SCHEMA)


def output_rows(table: pa.Table) -> list[OutputRow]:
    """The rows of an output table, or of any selection of its columns."""
    return [OutputRow.from_record(d) for d in table.to_pylist()]
