"""OpenAI-style rows: `messages` of `{role, content}`, optional `tool_calls`, top-level `tools`.

Roles: system, user, assistant, tool; `developer` -> system and `function` -> tool (older OpenAI
names). Content may be a string, null (assistant turns that only call tools) or a list of parts
(text kept, images/video dropped and counted). `reasoning_content` on assistant turns is kept so the
regenerator can decide what to do with history thinking. Keys the schema has no place for (`loss`,
`weight`, `type`, ...) are ignored: they describe training, not the prompt.
"""

from __future__ import annotations

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
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",
}
ALLOWED = ", ".join(ROLES)


def normalize(raw: dict, fields: Fields, images: ImageReader | None = None) -> Normalized:
    key = fields("messages")
    items = raw.get(key)
    if items is None:
        raise RowError(f"{key}: missing; a messages row needs a list of {{role, content}} messages")
    if not isinstance(items, list):
        raise RowError(f"{key}: expected a list of messages, got {type_name(items)}")
    if not items:
        raise RowError(f"{key}: empty conversation; a row needs at least one user turn")
    k_role, k_content = fields("role"), fields("content")
    messages: list[Message] = []
    dropped = 0
    media = RowMedia(raw, fields, images)
    for i, item in enumerate(items):
        where = f"{key}[{i}]"
        if not isinstance(item, dict):
            raise RowError(
                f"{where}: expected an object with {k_role!r} and {k_content!r}, got {type_name(item)}"
            )
        raw_role = item.get(k_role)
        if not isinstance(raw_role, str):
            raise RowError(f"{where}.{k_role}: expected a role string, got {type_name(raw_role)}")
        role = ROLES.get(raw_role.strip().lower())
        if role is None:
            raise RowError(f"{where}.{k_role}: unknown role {raw_role!r} (allowed: {ALLOWED})")
        calls = item.get("tool_calls")
        if k_content not in item and not calls:
            raise RowError(f"{where}.{k_content}: missing")
        text, n, refs = content_parts(item.get(k_content), f"{where}.{k_content}", media)
        dropped += n
        if role == "user" and not refs:
            require_prompt_text(item.get(k_content), text, f"{where}.{k_content}")
        extra: dict = {}
        if calls is not None:
            if not isinstance(calls, list):
                raise RowError(f"{where}.tool_calls: expected a list of tool calls, got {type_name(calls)}")
            if calls and role != "assistant":
                raise RowError(
                    f"{where}.tool_calls: only assistant messages can call tools (role {raw_role!r})"
                )
            if calls:
                extra["tool_calls"] = tuple(
                    tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)
                )
        if role == "assistant":
            extra["reasoning_content"] = check_text(
                item.get("reasoning_content"), f"{where}.reasoning_content", allow_none=True
            )
        if role == "tool":
            call_id = item.get("tool_call_id")
            extra["tool_call_id"] = None if call_id is None else str(call_id)
            extra["name"] = check_text(item.get("name"), f"{where}.name", allow_none=True)
        messages.append(message(role, text, images=refs or None, **extra))
    tools = tools_list(raw.get(fields("tools")), fields("tools"))
    media.finish()
    return Normalized(
        conversation(messages, tools, key), num_dropped_parts=dropped, images=media.loaded or None
    )
