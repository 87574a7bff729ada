"""Streamed replies of both APIs folded into one Completion, and the request timer.

The events come from sse.py (parsing, stall and size bounds). `GenerateStream` folds native /generate events
(cumulative by default, deltas with --incremental-streaming-output; the mode is checked on the chunks
themselves, never trusted blindly); `ChatStream` folds OpenAI chat
chunks (content, reasoning_content and tool-call deltas, the usage chunk). Errors inside events are
classified by http.py. Splitting thinking from the answer is chat_template.py's job.
"""

from __future__ import annotations

import json
import time

from regen_service.work.client.http import (
    Completion,
    ReplyTooLargeError,
    RetryableError,
    StreamModeError,
    check_abort,
    event_error,
    finish_type,
)
from schemas.conversation import ToolCall


def _bound(size: int, max_bytes: int | None, endpoint: str) -> None:
    if max_bytes is not None and size > max_bytes:
        raise ReplyTooLargeError(
            f"{endpoint} streamed more than max_reply_bytes ({max_bytes}) of answer; cut", endpoint=endpoint
        )


class Timer:
    def __init__(self) -> None:
        self.start = time.monotonic()
        self.first: float | None = None

    def token(self) -> None:
        if self.first is None:
            self.first = time.monotonic()

    def finish(self, c: Completion) -> Completion:
        end = time.monotonic()
        c.latency_s = end - self.start
        if self.first is not None:
            c.ttft_s = self.first - self.start
            n = (c.completion_tokens or 0) - 1
            c.decode_tok_s = n / (end - self.first) if n > 0 and end > self.first else None
        return c


class GenerateStream:
    """Folds native /generate events into a Completion (exact output_ids, raw text).

    SGLang sends totals by default and deltas under --incremental-streaming-output. `mode` is what the
    endpoint knows ("cumulative"/"incremental": config or /server_info; "auto": unknown). The chunks are
    checked either way: cumulative chunks must extend the previous one, and the folded ids must number
    the chunk's meta_info.completion_tokens (SGLang's len(req.output_ids), sent with every chunk). In
    auto mode both folds are kept until that count (or, without counts, three growing chunks that each
    extend the last) tells them apart; the delta fold is then dropped so memory stays linear. A stream
    that fits neither fold raises StreamModeError: never a truncated or doubled answer."""

    _SETTLE_CHUNKS = 3

    def __init__(self, endpoint: str, mode: str = "auto", max_bytes: int | None = None) -> None:
        self.endpoint = endpoint
        self.mode = mode
        self.max_bytes = max_bytes
        self.cat_size = 0  # bytes held by the delta fold (the cumulative one is bounded per line)
        self.text = ""  # cumulative fold: the last totals
        self.ids: list[int] = []
        self.cat_text: list[str] = []  # incremental fold: deltas joined (not kept once cumulative)
        self.cat_ids: list[int] = []
        self.grown = 0
        self.chunks = 0
        self.saw_ids = False
        self.meta: dict = {}
        self.timer = Timer()

    def _error(self, what: str) -> StreamModeError:
        return StreamModeError(f"{self.endpoint}: /generate {what}", endpoint=self.endpoint)

    def feed(self, event: dict) -> None:
        if "error" in event:
            raise event_error(event["error"], self.endpoint)
        text, raw_ids = event.get("text") or "", event.get("output_ids")
        meta = event.get("meta_info") or {}
        self.chunks += 1
        self.saw_ids = self.saw_ids or raw_ids is not None
        # a server that sends no ids (text only) is folded by text alone, as before
        ids = list(raw_ids) if raw_ids is not None else (self.ids if self.mode != "incremental" else [])
        if self.mode != "incremental":
            if ids[: len(self.ids)] == self.ids and text.startswith(self.text):
                self.grown += len(ids) > len(self.ids)
                self.text, self.ids = text, ids
            elif self.mode == "cumulative":
                raise self._error(
                    f"chunk {self.chunks} does not extend the previous one: the stream carries deltas, "
                    "not the totals expected (server restarted with --incremental-streaming-output?)"
                )
            else:
                self.mode = "incremental"  # auto: the cumulative shape is broken
        if self.mode != "cumulative":
            self.cat_text.append(text)
            self.cat_ids.extend(ids)
            self.cat_size += len(text) + 8 * len(ids)
            _bound(self.cat_size, self.max_bytes, self.endpoint)
        self._check(meta.get("completion_tokens") if raw_ids is not None else None)
        if ids or text:
            self.timer.token()
        self.meta = meta or self.meta

    def _check(self, count) -> None:
        """Hold the folds to the server's running count; in auto mode, settle the mode by it."""
        if not isinstance(count, int):
            if self.mode == "auto" and self.grown >= self._SETTLE_CHUNKS:
                self.mode, self.cat_ids, self.cat_text = "cumulative", [], []
            return
        fits_total = self.mode != "incremental" and len(self.ids) == count
        fits_delta = self.mode != "cumulative" and len(self.cat_ids) == count
        if self.mode == "auto" and fits_total != fits_delta:
            self.mode = "cumulative" if fits_total else "incremental"
            if fits_total:
                self.cat_ids, self.cat_text = [], []
        elif not (fits_total or fits_delta):
            got = len(self.ids) if self.mode == "cumulative" else len(self.cat_ids)
            raise self._error(
                f"chunk {self.chunks}: folded as {self.mode} it holds {got} output ids but the server "
                f"counted {count} (its stream mode is not the one expected)"
            )

    def _folded(self) -> tuple[str, list[int]]:
        if self.mode == "incremental":
            return "".join(self.cat_text), self.cat_ids
        return self.text, self.ids  # cumulative, or auto with both folds equal (or no count to tell)

    def result(self) -> Completion:
        fr = self.meta.get("finish_reason")
        if fr is None:
            raise RetryableError(
                f"{self.endpoint} ended the stream without a finish_reason", endpoint=self.endpoint
            )
        check_abort(fr, self.endpoint)
        text, ids = self._folded()
        return self.timer.finish(
            generate_completion(text, ids if self.saw_ids else None, self.meta, self.endpoint)
        )


def generate_completion_from_body(body: dict, endpoint: str) -> Completion:
    """A non-streaming /generate response."""
    if "error" in body:
        raise event_error(body["error"], endpoint)
    meta = body.get("meta_info") or {}
    check_abort(meta.get("finish_reason"), endpoint)
    return generate_completion(body.get("text") or "", body.get("output_ids"), meta, endpoint)


def generate_completion(text: str, ids: list[int] | None, meta: dict, endpoint: str) -> Completion:
    fr = meta.get("finish_reason")
    return Completion(
        text=text,
        output_ids=list(ids) if ids is not None else None,
        finish_reason=finish_type(fr),
        matched_stop=fr.get("matched") if isinstance(fr, dict) else None,
        prompt_tokens=meta.get("prompt_tokens"),
        completion_tokens=meta.get("completion_tokens", len(ids) if ids is not None else None),
        endpoint=endpoint,
        meta={k: v for k, v in meta.items() if k.startswith("spec_") or k in ("id", "cached_tokens")},
    )


class ChatStream:
    """Folds OpenAI chat completion chunks: deltas of content, reasoning_content and tool calls."""

    def __init__(self, endpoint: str, max_bytes: int | None = None) -> None:
        self.endpoint = endpoint
        self.max_bytes = max_bytes
        self.size = 0  # characters kept so far (content, reasoning, tool-call parts)
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict] = {}
        self.finish: str | None = None
        self.matched_stop: object = None
        self.usage: dict = {}
        self.timer = Timer()

    def feed(self, chunk: dict) -> None:
        if "error" in chunk:
            raise event_error(chunk["error"], self.endpoint)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            self.size += sum(len(v) for v in (delta.get("content"), delta.get("reasoning_content")) if v)
            self.size += sum(len(str(tc)) for tc in delta.get("tool_calls") or [])
            _bound(self.size, self.max_bytes, self.endpoint)
            if delta.get("content"):
                self.content.append(delta["content"])
                self.timer.token()
            # SGLang says reasoning_content; vLLM 0.32 says reasoning (its protocol renamed the field).
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                self.reasoning.append(reasoning)
                self.timer.token()
            for tc in delta.get("tool_calls") or []:
                self.timer.token()
                slot = self.calls.setdefault(
                    tc.get("index", len(self.calls)), {"id": None, "name": "", "args": []}
                )
                fn = tc.get("function") or {}
                slot["id"] = tc.get("id") or slot["id"]
                slot["name"] += fn.get("name") or ""
                slot["args"].append(fn.get("arguments") or "")
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
                self.matched_stop = choice.get("matched_stop")

    def result(self) -> Completion:
        if self.finish is None:
            raise RetryableError(
                f"{self.endpoint} ended the stream without a finish_reason", endpoint=self.endpoint
            )
        if self.finish == "abort":
            raise RetryableError(f"{self.endpoint} aborted the request", endpoint=self.endpoint)
        calls = [
            ToolCall(id=c["id"], name=c["name"], arguments="".join(c["args"]) or "{}")
            for _, c in sorted(self.calls.items())
        ]
        return self.timer.finish(
            chat_completion(
                "".join(self.content),
                "".join(self.reasoning) or None,
                calls or None,
                self.finish,
                self.matched_stop,
                self.usage,
                self.endpoint,
            )
        )


def chat_completion(
    content, reasoning, calls, finish, matched_stop, usage: dict, endpoint: str
) -> Completion:
    return Completion(
        content=content or "",
        reasoning_content=reasoning,
        tool_calls=calls,
        finish_reason=finish,
        matched_stop=matched_stop,
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
        endpoint=endpoint,
    )


def chat_message_completion(body: dict, endpoint: str) -> Completion:
    """A non-streaming chat response."""
    if "error" in body:
        raise event_error(body["error"], endpoint)
    choices = body.get("choices") or []
    if not choices:
        raise RetryableError(f"{endpoint} answered without choices", endpoint=endpoint)
    msg = choices[0].get("message") or {}
    finish = choices[0].get("finish_reason")
    if finish == "abort":
        raise RetryableError(f"{endpoint} aborted the request", endpoint=endpoint)
    calls = [
        ToolCall(
            id=tc.get("id"),
            name=(tc.get("function") or {}).get("name", ""),
            arguments=_args((tc.get("function") or {}).get("arguments")),
        )
        for tc in msg.get("tool_calls") or []
    ]
    return chat_completion(
        msg.get("content"),
        msg.get("reasoning_content") or msg.get("reasoning"),
        calls or None,
        finish,
        choices[0].get("matched_stop"),
        body.get("usage") or {},
        endpoint,
    )


def _args(value: object) -> str:
    if value is None:
        return "{}"
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
