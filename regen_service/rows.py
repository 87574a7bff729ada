"""Conversion between the pydantic records of `schemas` and the pyarrow tables written to storage."""

from __future__ import annotations

import json
from collections.abc import Iterable

import pyarrow as pa

from schemas.conversation import Conversation, Message, PromptRecord, ToolCall
from schemas.tables import OUTPUT_SCHEMA, PROMPT_SCHEMA


def message_to_arrow(m: Message) -> dict:
    return {
        "role": m.role,
        "content": m.content,
        "reasoning_content": m.reasoning_content,
        "tool_calls": [tc.model_dump() for tc in m.tool_calls] if m.tool_calls is not None else None,
        "name": m.name,
        "tool_call_id": m.tool_call_id,
    }


def message_from_arrow(d: dict) -> Message:
    tcs = d.get("tool_calls")
    return Message(
        role=d["role"],
        content=d.get("content") or "",
        reasoning_content=d.get("reasoning_content"),
        tool_calls=tuple(ToolCall(**tc) for tc in tcs) if tcs is not None else None,
        name=d.get("name"),
        tool_call_id=d.get("tool_call_id"),
    )


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
                "messages": [message_to_arrow(m) for m in conv.messages] if conv else None,
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
                messages=tuple(message_from_arrow(m) for m in d["messages"]),
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


def outputs_to_table(rows: list[dict]) -> pa.Table:
    """Rows are plain dicts with OUTPUT_SCHEMA's column names (missing ones become null)."""
    return pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA)
