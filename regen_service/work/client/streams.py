"""Server-sent events of both SGLang APIs, parsed into one Completion, with an idle (stall) timer.

`sse_events` turns the response's lines into JSON objects, ending at `data: [DONE]`, and raises
StallError when no line arrives for stall_timeout_s. `GenerateStream` folds native /generate events
(cumulative by default, deltas with --incremental-streaming-output; the mode is checked on the chunks
themselves, never trusted blindly); `ChatStream` folds OpenAI chat
chunks (content, reasoning_content and tool-call deltas, the usage chunk). Errors inside events are
classified by http.py. Splitting thinking from the answer is chat_template.py's job.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

from regen_service.work.client.auth import scrub_secrets
from regen_service.work.client.http import (
    Completion,
    ReplyTooLargeError,
    RetryableError,
    StallError,
    StreamModeError,
    check_abort,
    event_error,
    finish_type,
)
from schemas.conversation import ToolCall

_DONE = object()


class _SSEParser:
    """Lines in, JSON payloads out: `data:` fields joined, an event per blank line, [DONE] the end."""

    __slots__ = ("data", "endpoint")

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.data: list[str] = []

    def line(self, line: str) -> object:
        """The event this line completes (a dict, or _DONE), else None."""
        if line.startswith("data:"):
            self.data.append(line[5:].lstrip(" "))
            return None
        if line.startswith(":") or line.strip() or not self.data:
            return None  # comments, other fields (event:, id:) and keep-alive blank lines
        payload = "\n".join(self.data) if len(self.data) > 1 else self.data[0]
        self.data = []
        if payload.strip() == "[DONE]":
            return _DONE
        try:
            obj = json.loads(payload)
        except ValueError:
            raise RetryableError(
                f"{self.endpoint} sent a malformed event: {scrub_secrets(payload[:200])!r}",
                endpoint=self.endpoint,
            ) from None
        return obj if isinstance(obj, dict) else None


def _closed_early(endpoint: str) -> RetryableError:
    return RetryableError(f"{endpoint} closed the stream before [DONE]", endpoint=endpoint)


def _stalled(endpoint: str, stall_timeout_s: float) -> StallError:
    return StallError(f"{endpoint} sent nothing for {stall_timeout_s:g}s (stalled stream)", endpoint=endpoint)


async def sse_events(lines: AsyncIterator[str], stall_timeout_s: float, endpoint: str) -> AsyncIterator[dict]:
    """JSON payloads of `data:` events until [DONE]; a stream that ends without [DONE] is retryable."""
    it = lines.__aiter__()
    parser = _SSEParser(endpoint)
    while True:
        try:
            line = await asyncio.wait_for(it.__anext__(), stall_timeout_s)
        except StopAsyncIteration:
            raise _closed_early(endpoint) from None
        except asyncio.TimeoutError:
            raise _stalled(endpoint, stall_timeout_s) from None
        event = parser.line(line)
        if event is _DONE:
            return
        if event is not None:
            yield event


if hasattr(asyncio, "timeout"):  # Python >= 3.11: a timer handle, no extra task per read

    async def _read_chunk(reader, left: float) -> bytes:
        async with asyncio.timeout(left):
            return await reader.readany()

else:  # pragma: no cover - Python 3.10

    async def _read_chunk(reader, left: float) -> bytes:
        return await asyncio.wait_for(reader.readany(), left)


async def read_sse(
    reader,
    stall_timeout_s: float,
    endpoint: str,
    feed: Callable[[dict], None],
    *,
    max_line_bytes: int | None = None,
    max_events: int | None = None,
) -> None:
    """Feed every event of an SSE body (an aiohttp StreamReader) to `feed` until [DONE], then read the
    body to its end so that the keep-alive connection goes back to the pool instead of being closed.

    The stall timer is an idle timer on lines: StallError when no complete line arrives for
    stall_timeout_s. A body that ends before [DONE] is retryable. Lines end with LF or CRLF. Bytes that
    keep arriving defeat the stall timer, so two bounds cut a runaway stream (ReplyTooLargeError,
    retryable): a line longer than max_line_bytes, and more than max_events events."""
    loop = asyncio.get_running_loop()
    parser = _SSEParser(endpoint)
    deadline = loop.time() + stall_timeout_s
    tail = b""
    events = 0
    while True:
        try:
            chunk = await _read_chunk(reader, deadline - loop.time())
        except (asyncio.TimeoutError, TimeoutError):
            raise _stalled(endpoint, stall_timeout_s) from None
        if not chunk:  # end of body
            if tail:  # a last line without its newline
                parser.line(tail.decode("utf-8", "replace").rstrip("\r"))
            raise _closed_early(endpoint)
        parts = (tail + chunk).split(b"\n") if tail else chunk.split(b"\n")
        tail = parts.pop()
        if max_line_bytes is not None and len(tail) > max_line_bytes:
            raise ReplyTooLargeError(
                f"{endpoint} sent a stream line over max_reply_bytes ({max_line_bytes} bytes); cut",
                endpoint=endpoint,
            )
        if not parts:
            continue
        deadline = loop.time() + stall_timeout_s
        for raw in parts:
            event = parser.line(raw.decode("utf-8", "replace").rstrip("\r"))
            if event is None:
                continue
            if event is _DONE:
                await _drain(reader, loop)
                return
            events += 1
            if max_events is not None and events > max_events:
                raise ReplyTooLargeError(
                    f"{endpoint} kept streaming past max_new_tokens ({events} events, at most {max_events} "
                    "expected); cut",
                    endpoint=endpoint,
                )
            feed(event)


async def _drain(reader, loop, limit_s: float = 1.0) -> None:
    """Read what follows [DONE] (the chunked terminator) for up to limit_s; a server that keeps the
    body open longer just costs its connection (closed on release instead of reused)."""
    deadline = loop.time() + limit_s
    try:
        while await _read_chunk(reader, deadline - loop.time()):
            pass
    except Exception:  # a timeout or a cut connection: the answer is complete already
        pass


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
