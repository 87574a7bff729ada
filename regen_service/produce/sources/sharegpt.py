"""ShareGPT rows: `conversations` of `{from, value}` turns, optional top-level `system` and `tools`.

Roles: human/user -> user; gpt/assistant/chatgpt/bard/model -> assistant; system -> system;
tool/function/observation -> tool; function_call -> a tool call whose value is the JSON
`{"name": ..., "arguments": ...}` (arguments as an object or a string).

A function_call turn joins the assistant turn right before it when there is one (a gpt turn that
speaks and then calls, or a run of function_call turns = parallel calls); otherwise it becomes an
assistant turn with empty content. The top-level `system` string becomes a leading system turn unless
the conversation already starts with one (then both are kept, top-level first).
"""

from __future__ import annotations

import json
from typing import Any

from regen_service.produce.sources.base import (
    Fields,
    Normalized,
    RowError,
    check_text,
    conversation,
    message,
    require_prompt_text,
    tool_call,
    tools_list,
    type_name,
)
from regen_service.produce.sources.images import ImageReader
from regen_service.produce.sources.parts import RowMedia, content_parts
from schemas.conversation import Message

ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "function_call": "function_call",
}
ALLOWED = ", ".join(ROLES)


def _parse_call(value: Any, where: str):
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise RowError(
                f'{where}: a function_call value must be JSON {{"name": ..., "arguments": ...}} '
                f"({err.msg} at char {err.pos})"
            ) from None
    return tool_call(value, where)


def normalize(raw: dict, fields: Fields, images: ImageReader | None = None) -> Normalized:
    key = fields("conversations")
    turns = raw.get(key)
    if turns is None:
        raise RowError(f"{key}: missing; a sharegpt row needs a list of {{from, value}} turns")
    if not isinstance(turns, list):
        raise RowError(f"{key}: expected a list of turns, got {type_name(turns)}")
    if not turns:
        raise RowError(f"{key}: empty conversation; a row needs at least one user turn")
    k_from, k_value = fields("from"), fields("value")
    messages: list[Message] = []
    dropped = 0
    media = RowMedia(raw, fields, images)
    system = check_text(raw.get(fields("system")), fields("system"), allow_none=True)
    if system:
        messages.append(message("system", system))
    # index in `messages` of an assistant turn a following function_call may attach to
    open_assistant = -1
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise RowError(
                f"{where}: expected an object with {k_from!r} and {k_value!r}, got {type_name(turn)}"
            )
        speaker = turn.get(k_from)
        if not isinstance(speaker, str):
            raise RowError(f"{where}.{k_from}: expected a role string, got {type_name(speaker)}")
        role = ROLES.get(speaker.strip().lower())
        if role is None:
            raise RowError(f"{where}.{k_from}: unknown role {speaker!r} (allowed: {ALLOWED})")
        if k_value not in turn:
            raise RowError(f"{where}.{k_value}: missing")
        if role == "function_call":
            call = _parse_call(turn[k_value], f"{where}.{k_value}")
            if open_assistant >= 0:
                prev = messages[open_assistant]
                messages[open_assistant] = prev.model_copy(
                    update={"tool_calls": (*(prev.tool_calls or ()), call)}
                )
            else:
                messages.append(message("assistant", "", tool_calls=(call,)))
                open_assistant = len(messages) - 1
            continue
        text, n, refs = content_parts(turn[k_value], f"{where}.{k_value}", media)
        dropped += n
        if role == "user" and not refs:
            require_prompt_text(turn[k_value], text, f"{where}.{k_value}")
        messages.append(message(role, text, images=refs or None))
        open_assistant = len(messages) - 1 if role == "assistant" else -1
    tools = tools_list(raw.get(fields("tools")), fields("tools"))
    media.finish()
    return Normalized(
        conversation(messages, tools, key), num_dropped_parts=dropped, images=media.loaded or None
    )
