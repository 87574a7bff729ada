"""Server-sent events of both SGLang APIs, parsed into one Completion, with an idle (stall) timer.

`sse_events` turns the response's lines into JSON objects, ending at `data: [DONE]`, and raises
StallError when no line arrives for stall_timeout_s. `GenerateStream` folds native /generate events
(cumulative by default, deltas with --incremental-streaming-output); `ChatStream` folds OpenAI chat
chunks (content, reasoning_content and tool-call deltas, the usage chunk). Errors inside events are
classified by http.py. Splitting thinking from the answer is chat_template.py's job.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from regen_service.client.http import (
    Completion,
    RetryableError,
    StallError,
    check_abort,
    event_error,
    finish_type,
)
from schemas.conversation import ToolCall


async def sse_events(lines: AsyncIterator[str], stall_timeout_s: float, endpoint: str) -> AsyncIterator[dict]:
    """JSON payloads of `data:` events until [DONE]; a stream that ends without [DONE] is retryable."""
    it = lines.__aiter__()
    data: list[str] = []
    while True:
        try:
            # The idle timer: httpx's read timeout resets on any byte, this one on any line.
            line = await asyncio.wait_for(it.__anext__(), stall_timeout_s)
        except StopAsyncIteration:
            raise RetryableError(f"{endpoint} closed the stream before [DONE]", endpoint=endpoint) from None
        except asyncio.TimeoutError:
            raise StallError(
                f"{endpoint} sent nothing for {stall_timeout_s:g}s (stalled stream)", endpoint=endpoint
            ) from None
        if line.startswith(":"):
            continue
        if line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
            continue
        if line.strip() or not data:
            continue  # other fields (event:, id:) and keep-alive blank lines
        payload = "\n".join(data)
        data = []
        if payload.strip() == "[DONE]":
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            raise RetryableError(
                f"{endpoint} sent a malformed event: {payload[:200]!r}", endpoint=endpoint
            ) from None
        if isinstance(obj, dict):
            yield obj


class _Timer:
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
    """Folds native /generate events into a Completion (exact output_ids, raw text)."""

    def __init__(self, endpoint: str, incremental: bool) -> None:
        self.endpoint = endpoint
        self.incremental = incremental
        self.text = ""
        self.ids: list[int] = []
        self.meta: dict = {}
        self.timer = _Timer()

    def feed(self, event: dict) -> None:
        if "error" in event:
            raise event_error(event["error"], self.endpoint)
        text, ids = event.get("text") or "", event.get("output_ids")
        if self.incremental:
            self.text += text
            self.ids.extend(ids or [])
        else:
            self.text = text or self.text
            self.ids = list(ids) if ids is not None else self.ids
        if self.ids or self.text:
            self.timer.token()
        self.meta = event.get("meta_info") or self.meta

    def result(self) -> Completion:
        fr = self.meta.get("finish_reason")
        if fr is None:
            raise RetryableError(
                f"{self.endpoint} ended the stream without a finish_reason", endpoint=self.endpoint
            )
        check_abort(fr, self.endpoint)
        return self.timer.finish(generate_completion(self.text, self.ids, self.meta, self.endpoint))


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

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict] = {}
        self.finish: str | None = None
        self.matched_stop: object = None
        self.usage: dict = {}
        self.timer = _Timer()

    def feed(self, chunk: dict) -> None:
        if "error" in chunk:
            raise event_error(chunk["error"], self.endpoint)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.content.append(delta["content"])
                self.timer.token()
            if delta.get("reasoning_content"):
                self.reasoning.append(delta["reasoning_content"])
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
        msg.get("reasoning_content"),
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
