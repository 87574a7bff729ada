"""The one conversation shape every input format normalizes to, and the stable prompt id.

Sources (regen_service.produce.sources) turn dataset rows into `Conversation`s; this module only defines
the shape, its validation rules and the content hash. It does not read files or talk to servers.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from schemas.media import ImageRef, content_parts

Role = Literal["system", "user", "assistant", "tool"]


class ToolCall(BaseModel):
    """One function call made by an assistant turn. `arguments` is always a JSON string."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str | None = None
    name: str
    arguments: str = "{}"


MessageForm = Literal["arrow", "template"]


class Message(BaseModel):
    """One turn. `to_dict`/`from_dict` are the only conversion to and from plain dicts: the prompt
    shard, the generation request and the trainer's template input all go through them, so the
    trainer sees exactly the messages the target saw."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Role
    content: str = ""
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] | None = None
    # For role "tool": the function's name and the id of the call it answers, when the dataset has them.
    name: str | None = None
    tool_call_id: str | None = None
    # Image parts, placed in `content` by character offset (schemas.media); None for text-only turns,
    # so their canonical JSON, and with it every text-only prompt id, is what it was before images.
    images: tuple[ImageRef, ...] | None = None

    def to_dict(self, form: MessageForm) -> dict:
        """This message as a plain dict, in one of two forms that carry the same information:

        - "arrow": a value of schemas.tables.MESSAGE (every key present, None kept, tool calls flat
          `{id, name, arguments}`), as prompt and output shards store it;
        - "template": the OpenAI-style dict the chat API and HF chat templates take (None fields and
          an empty tool-call list left out, since templates test keys for presence; tool calls as
          `{id, type: "function", function: {name, arguments}}`). Generation requests and the
          trainer's renderer both use this form. A message with images has its content as a list of
          parts (schemas.media.content_parts), text and `image_url` parts in their original order.

        The "arrow" form leaves `images` out: a prompt shard holds them in its own `images` column
        (schemas.prompt_rows), so the MESSAGE struct, and text-only shards, keep their bytes.
        """
        if form == "arrow":
            calls = None
            if self.tool_calls is not None:
                calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in self.tool_calls]
            return {
                "role": self.role,
                "content": self.content,
                "reasoning_content": self.reasoning_content,
                "tool_calls": calls,
                "name": self.name,
                "tool_call_id": self.tool_call_id,
            }
        if form != "template":
            raise ValueError(f"unknown message form {form!r}: 'arrow' or 'template'")
        content = content_parts(self.content, self.images) if self.images else self.content
        d: dict = {"role": self.role, "content": content}
        if self.reasoning_content is not None:
            d["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.name is not None:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Message:
        """A Message from the "arrow" form (a stored MESSAGE value, or its JSON); null content reads as ""."""
        calls = d.get("tool_calls")
        return cls(
            role=d["role"],
            content=d.get("content") or "",
            reasoning_content=d.get("reasoning_content"),
            tool_calls=tuple(ToolCall(**c) for c in calls) if calls is not None else None,
            name=d.get("name"),
            tool_call_id=d.get("tool_call_id"),
        )


def image_parts(messages) -> list[dict] | None:
    """The `images` column value of a row (schemas.media.IMAGE_PART): each image part of the messages
    with the index of its message; None when there is none (text-only rows stay null)."""
    parts = [
        {"message_index": i, **ref.model_dump()} for i, m in enumerate(messages) for ref in m.images or ()
    ]
    return parts or None


def with_image_parts(messages: list[Message], parts: list[dict] | None) -> list[Message]:
    """The messages with the `images` column's parts put back on the messages they belong to."""
    by_message: dict[int, list[ImageRef]] = {}
    for p in parts or ():
        fields = {k: v for k, v in p.items() if k != "message_index"}
        by_message.setdefault(p["message_index"], []).append(ImageRef(**fields))
    return [
        m.model_copy(update={"images": tuple(by_message[i])}) if i in by_message else m
        for i, m in enumerate(messages)
    ]


class Conversation(BaseModel):
    """A normalized conversation: messages in order, and the tools offered (OpenAI function schemas)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    messages: tuple[Message, ...] = Field(min_length=1)
    tools: tuple[dict, ...] | None = None

    @model_validator(mode="after")
    def _has_a_user_turn(self) -> Conversation:
        roles = [m.role for m in self.messages]
        if "user" not in roles:
            raise ValueError(
                f"conversation has no user turn (roles: {roles}); nothing to prompt the target with"
            )
        return self

    def canonical_json(self) -> str:
        """The text the prompt id hashes: sorted keys, no whitespace, None fields dropped."""
        payload = {
            "messages": [m.model_dump(exclude_none=True) for m in self.messages],
            "tools": list(self.tools) if self.tools else None,
        }
        return json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def compute_prompt_id(conversation: Conversation | None, input_ids: list[int] | None = None) -> str:
    """A stable id: sha256 over the canonical conversation (or the pretokenized ids), 24 hex chars.

    The id depends on content only, never on the source name or row index, so the same prompt in two
    datasets (or two runs) has the same id: that is what cross-source dedup and reuse key on.
    """
    h = hashlib.sha256()
    if conversation is not None:
        h.update(b"conv\0")
        h.update(conversation.canonical_json().encode("utf-8"))
    if input_ids is not None:
        h.update(b"ids\0")
        h.update(json.dumps(list(input_ids), separators=(",", ":")).encode())
    return h.hexdigest()[:24]


class PromptRecord(BaseModel):
    """One row of a prompt shard: a normalized conversation (or pretokenized ids) and where it came from."""

    model_config = ConfigDict(extra="forbid")

    prompt_id: str
    source: str
    row_index: int
    conversation: Conversation | None = None
    # pretokenized passthrough: produced by the target already, written to the output unchanged
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    # how many non-text content parts (images, video) were dropped while normalizing
    num_dropped_parts: int = 0

    @model_validator(mode="after")
    def _one_payload(self) -> PromptRecord:
        if (self.conversation is None) == (self.input_ids is None):
            raise ValueError("a prompt record holds either a conversation or input_ids, not both or neither")
        if self.input_ids is not None and (
            self.loss_mask is None or len(self.loss_mask) != len(self.input_ids)
        ):
            raise ValueError("pretokenized rows need a loss_mask of the same length as input_ids")
        return self
