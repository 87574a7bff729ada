"""Prompt shard rows (PROMPT_SCHEMA) <-> PromptRecords, and the `tools` column's JSON.

The prompt side's codec, twin of schemas.rows (OutputRow <-> OUTPUT_SCHEMA): the producer writes rows
with `prompt_row`, the worker reads them back with `prompts_from_table`, both through this one module,
so neither stage imports the other. Image parts ride in their own `images` column (message index
+ schemas.media.ImageRef), present only in shards that hold images (`prompt_table`), so a text-only
shard is written exactly as before images existed. Messages convert through schemas.conversation.Message.to_dict /
from_dict; this module only adds the prompt shard's table on top of them. pyarrow and json only.
"""

from __future__ import annotations

import json

import pyarrow as pa

from schemas.conversation import Conversation, Message, PromptRecord, image_parts, with_image_parts
from schemas.tables import PROMPT_SCHEMA, PROMPT_SCHEMA_IMAGES


def tools_to_json(tools: tuple[dict, ...] | None) -> str | None:
    return json.dumps(list(tools), ensure_ascii=False, sort_keys=True) if tools else None


def tools_from_json(s: str | None) -> tuple[dict, ...] | None:
    return tuple(json.loads(s)) if s else None


def prompt_row(
    *,
    prompt_id: str,
    source: str,
    row_index: int,
    conversation: Conversation | None,
    input_ids: list[int] | None,
    loss_mask: list[int] | None,
    num_dropped_parts: int,
) -> dict:
    """One PROMPT_SCHEMA row (prepare builds them straight from normalized rows: a PromptRecord round
    trip per row dominated its profile); prompts_from_table reads them back."""
    conv = conversation
    return {
        "prompt_id": prompt_id,
        "source": source,
        "row_index": row_index,
        "messages": [m.to_dict("arrow") for m in conv.messages] if conv is not None else None,
        "tools": tools_to_json(conv.tools) if conv is not None else None,
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "num_dropped_parts": num_dropped_parts,
        "images": image_parts(conv.messages) if conv is not None else None,
    }


def prompt_table(rows: list[dict]) -> pa.Table:
    """A prompt shard of `prompt_row` rows: PROMPT_SCHEMA, or PROMPT_SCHEMA_IMAGES (schema version 2)
    when any row has an image part; pyarrow ignores the `images` key under PROMPT_SCHEMA."""
    schema = PROMPT_SCHEMA_IMAGES if any(r.get("images") for r in rows) else PROMPT_SCHEMA
    return pa.Table.from_pylist(rows, schema=schema)


def prompts_from_table(table: pa.Table) -> list[PromptRecord]:
    out = []
    for d in table.to_pylist():
        conv = None
        if d["messages"] is not None:
            messages = [Message.from_dict(m) for m in d["messages"]]
            conv = Conversation(
                messages=tuple(with_image_parts(messages, d.get("images"))),
                tools=tools_from_json(d["tools"]),
            )
        out.append(
            PromptRecord(
                prompt_id=d["prompt_id"],
                source=d["source"],
                row_index=d["row_index"],
                conversation=conv,
                input_ids=d["input_ids"],
                loss_mask=d["loss_mask"],
                num_dropped_parts=d["num_dropped_parts"] or 0,
            )
        )
    return out
