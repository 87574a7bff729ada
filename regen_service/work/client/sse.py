"""Server-sent events off the wire: lines to JSON payloads, bounded in size and time.

`sse_events` turns the response's lines into JSON objects, ending at `data: [DONE]`, and raises
StallError when no line arrives for stall_timeout_s; `read_sse` does the same straight off aiohttp's
reader with the reply's byte and event caps. What the payloads mean (folding /generate and chat chunks
into a Completion) is streams.py's; errors inside events are classified by http.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from regen_service.work.client.auth import scrub_secrets
from regen_service.work.client.http import ReplyTooLargeError, RetryableError, StallError

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
