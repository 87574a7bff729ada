"""Prompt shards <-> PromptRecords, and the `tools` column's JSON.

Messages convert through schemas.conversation.Message.to_dict/from_dict and output rows through
schemas.rows (OutputRow); this module only adds the prompt shard's table on top of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import pyarrow as pa

from schemas.conversation import Conversation, Message, PromptRecord
from schemas.tables import PROMPT_SCHEMA


def tools_to_json(tools: tuple[dict, ...] | None) -> str | None:
    return json.dumps(list(tools), ensure_ascii=False, sort_keys=True) if tools else None


def tools_from_json(s: str | None) -> tuple[dict, ...] | None:
    return tuple(json.loads(s)) if s else None


def prompts_to_table(records: Iterable[PromptRecord]) -> pa.Table:
    rows = []
    for r in records:
        conv = r.conversation
        rows.append(
            {
                "prompt_id": r.prompt_id,
                "source": r.source,
                "row_index": r.row_index,
                "messages": [m.to_dict("arrow") for m in conv.messages] if conv else None,
                "tools": tools_to_json(conv.tools) if conv else None,
                "input_ids": r.input_ids,
                "loss_mask": r.loss_mask,
                "num_dropped_parts": r.num_dropped_parts,
            }
        )
    return pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA)


def prompts_from_table(table: pa.Table) -> list[PromptRecord]:
    out = []
    for d in table.to_pylist():
        conv = None
        if d["messages"] is not None:
            conv = Conversation(
                messages=tuple(Message.from_dict(m) for m in d["messages"]),
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
