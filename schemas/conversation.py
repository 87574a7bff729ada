"""The one conversation shape every input format normalizes to, and the stable prompt id.

Sources (regen_service.sources) turn dataset rows into `Conversation`s; this module only defines
the shape, its validation rules and the content hash. It does not read files or talk to servers.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Role = Literal["system", "user", "assistant", "tool"]


class ToolCall(BaseModel):
    """One function call made by an assistant turn. `arguments` is always a JSON string."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str | None = None
    name: str
    arguments: str = "{}"


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Role
    content: str = ""
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCall, ...] | None = None
    # For role "tool": the function's name and the id of the call it answers, when the dataset has them.
    name: str | None = None
    tool_call_id: str | None = None


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
