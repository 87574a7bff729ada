"""What every input format shares: the row error, field renames, and checked builders of messages.

A normalizer (one module per format) takes one raw dataset row (a dict) and returns a `Normalized`
(a schemas.Conversation, or pretokenized ids) or raises `RowError` with a reason that names the field
and says what was expected, e.g. "conversations[2].from: unknown role 'narrator' (allowed: ...)".
The helpers here check types themselves before any pydantic model is built, so a bad row gets a
message a dataset owner can act on, never a pydantic traceback. Reading files, sampling, dedup and
writing shards are the producer's job (regen_service.produce.prepare), not this module's.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from pydantic import ValidationError

from schemas.conversation import Conversation, Message, ToolCall


class RowError(ValueError):
    """A row that cannot be normalized; `reason` says which field is wrong and, where it can, how to fix it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Normalized(NamedTuple):
    conversation: Conversation | None
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    num_dropped_parts: int = 0
    # the row's images by sha256 (images.LoadedImage: ref and bytes), for the producer to store once
    images: dict | None = None


class Fields:
    """Canonical field name -> the dataset's name, from SourceSpec.fields ({canonical: dataset_field}).

    Renames apply to top-level keys and to the keys inside turns (e.g. `{from: role, value: text}`
    for a ShareGPT file whose turns use other names); a name without a rename maps to itself.
    """

    __slots__ = ("_map",)

    def __init__(self, renames: dict[str, str] | None = None):
        self._map = dict(renames or {})

    def __call__(self, canonical: str) -> str:
        return self._map.get(canonical, canonical)


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def check_text(value: Any, where: str, *, allow_none: bool = False) -> str | None:
    """A string that encodes as UTF-8 (lone surrogates from `\\ud800`-style escapes do not)."""
    if value is None and allow_none:
        return None
    if not isinstance(value, str):
        raise RowError(f"{where}: expected a string, got {type_name(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise RowError(
            f"{where}: invalid text (unpaired surrogate {value[err.start]!r} at character {err.start}); "
            "fix the escape in the dataset or drop the row"
        ) from None
    return value


def require_prompt_text(raw: Any, text: str, where: str) -> str:
    """The text of a user turn, or RowError when it would reach the target as an empty prompt.

    `parts.content_parts` reads null as "" because an assistant turn that only calls tools has no text; a
    user turn with nothing in it (null, "", whitespace, an empty part list) has nothing to answer,
    and sending it anyway teaches the draft what the target says to an empty message.
    """
    if text.strip():
        return text
    if raw is None:
        got = "null"
    elif isinstance(raw, str):
        got = "only whitespace" if raw else "an empty string"
    else:
        got = "no text in its parts"
    raise RowError(
        f"{where}: empty user turn ({got}); nothing to prompt the target with; "
        "fill in the turn's text or remove the row"
    )


def arguments_json(value: Any, where: str) -> str:
    """Tool-call arguments as a JSON string: strings pass verbatim, objects are serialized."""
    if value is None:
        return "{}"
    if isinstance(value, str):
        return check_text(value, where)
    if isinstance(value, dict | list):
        try:
            return check_text(json.dumps(value, ensure_ascii=False), where)
        except RowError:
            raise
        except (TypeError, ValueError) as err:
            raise RowError(f"{where}: arguments cannot be serialized as JSON ({err})") from None
    raise RowError(f"{where}: expected a JSON string or an object, got {type_name(value)}")


def tool_call(value: Any, where: str) -> ToolCall:
    """One call, OpenAI-shaped `{id, type, function: {name, arguments}}` or flat `{name, arguments}`."""
    if not isinstance(value, dict):
        raise RowError(f"{where}: expected a tool call object, got {type_name(value)}")
    fn = value.get("function")
    if fn is None:
        fn, fn_where = value, where
    elif isinstance(fn, dict):
        fn_where = f"{where}.function"
    else:
        raise RowError(f"{where}.function: expected an object with name and arguments, got {type_name(fn)}")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise RowError(f"{fn_where}.name: expected a non-empty function name, got {name!r}")
    check_text(name, f"{fn_where}.name")
    call_id = value.get("id")
    if call_id is not None:
        call_id = check_text(str(call_id), f"{where}.id")
    return ToolCall(
        id=call_id, name=name, arguments=arguments_json(fn.get("arguments"), f"{fn_where}.arguments")
    )


def tools_list(value: Any, where: str) -> tuple[dict, ...] | None:
    """Declared tools as OpenAI function schemas; accepts a list or a JSON string holding one.

    Bare `{name, description, parameters}` entries (LLaMA-Factory/Glaive style) are wrapped as
    `{"type": "function", "function": {...}}`; an empty list (or the string "[]") means no tools.
    """
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise RowError(
                f"{where}: a string that is not valid JSON ({err.msg} at char {err.pos})"
            ) from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise RowError(
            f"{where}: expected a list of tool schemas (or a JSON string of one), got {type_name(value)}"
        )
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise RowError(f"{where}[{i}]: expected a tool schema object, got {type_name(tool)}")
        if "function" not in tool and "name" in tool:
            tool = {"type": "function", "function": tool}
        out.append(tool)
    try:
        check_text(json.dumps(out, ensure_ascii=False), where)
    except RowError:
        raise
    except (TypeError, ValueError) as err:
        raise RowError(f"{where}: tool schemas are not JSON-serializable ({err})") from None
    return tuple(out) or None


def message(role: str, content: str, **extra: Any) -> Message:
    return Message(role=role, content=content, **{k: v for k, v in extra.items() if v is not None})


def pair_tool_results(messages: list[Message]) -> list[Message]:
    """Give tool results without a name or id the name (and id, if any) of the call they answer.

    Datasets often omit `tool_call_id`; results are matched to the preceding assistant turn's calls
    in order, which is how every chat template that ignores ids already reads them.
    """
    out: list[Message] = []
    pending: list[ToolCall] = []
    for m in messages:
        if m.role == "assistant":
            pending = list(m.tool_calls or ())
        elif m.role == "tool" and pending:
            call = pending.pop(0)
            if m.name is None or m.tool_call_id is None:
                m = m.model_copy(
                    update={"name": m.name or call.name, "tool_call_id": m.tool_call_id or call.id}
                )
        elif m.role == "user":
            pending = []
        out.append(m)
    return out


def conversation(messages: list[Message], tools: tuple[dict, ...] | None, where: str) -> Conversation:
    if not messages:
        raise RowError(f"{where}: empty conversation; a row needs at least one user turn")
    if not any(m.role == "user" for m in messages):
        roles = [m.role for m in messages]
        raise RowError(f"{where}: no user turn (roles: {roles}); nothing to prompt the target with")
    for i, m in enumerate(messages):
        # the formats check their own turns with the field path; this holds the rule for any format
        if m.role == "user" and not m.images:  # an image alone is something to answer
            require_prompt_text(m.content, m.content, f"{where} (message {i})")
    try:
        return Conversation(messages=tuple(pair_tool_results(messages)), tools=tools)
    except ValidationError as err:
        raise RowError(f"{where}: {err.errors()[0]['msg']}") from None
