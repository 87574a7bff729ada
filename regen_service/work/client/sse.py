"""Server-sent events off the wire: lines to JSON payloads, bounded in size and time.

`sse_events` turns the response's lines into JSON objects, ending at `data: [DONE]`; `read_sse` does
the same straight off aiohttp's reader. Both hold a stream to three bounds, because bytes that keep
arriving defeat an idle timer:
  stall       StallError when no event completes for stall_timeout_s. Only progress counts: SSE
              comments (`: keepalive`), blank lines, other fields and the data lines of an event that
              never ends reset nothing, so a server that only keeps the socket busy is cut.
  event size  ReplyTooLargeError when one event's data lines (or one line) pass max_event_bytes
              without the blank line that ends the event: what a parser holds is bounded.
  events      ReplyTooLargeError past max_events completed events (JSON objects or not).
All three are retryable (errors.py): a broken or runaway stream is the server's fault, not the row's,
and another attempt (or endpoint) may answer; one that persists ends the row as retries_exhausted,
and the breaker ejects an endpoint that keeps failing. What the payloads mean (folding /generate and
chat chunks into a Completion) is streams.py's; errors inside events are classified by http.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from regen_service.work.client.http import ReplyTooLargeError, RetryableError, StallError
from regen_service.work.client.server_text import server_text

_DONE = object()
# What holding one data line costs beyond its bytes (a str object and a list slot): counted, so that an
# event of many tiny lines is bounded by the memory it takes, not only by its bytes on the wire.
_LINE_OVERHEAD = 64
_SKIP = object()  # a completed event whose payload is not a JSON object: counted, not fed


class _SSEParser:
    """Lines in, JSON payloads out: `data:` fields joined, an event per blank line, [DONE] the end.
    `size` is what the current event holds (its data lines' bytes and their overhead), at most `max_bytes`."""

    __slots__ = ("data", "endpoint", "max_bytes", "size")

    def __init__(self, endpoint: str, max_bytes: int | None = None) -> None:
        self.endpoint = endpoint
        self.max_bytes = max_bytes
        self.data: list[str] = []
        self.size = 0

    def line(self, line: str, nbytes: int | None = None) -> object:
        """The event this line completes (a dict, _SKIP or _DONE), else None."""
        if line.startswith("data:"):
            self.size += (len(line) if nbytes is None else nbytes) + _LINE_OVERHEAD
            if self.max_bytes is not None and self.size > self.max_bytes:
                raise ReplyTooLargeError(
                    f"{self.endpoint} sent a stream event over max_reply_bytes ({self.max_bytes} bytes of "
                    f"data lines, {len(self.data) + 1} lines, without the blank line that ends an event); cut",
                    endpoint=self.endpoint,
                )
            self.data.append(line[5:].lstrip(" "))
            return None
        if line.startswith(":") or line.strip() or not self.data:
            return None  # comments, other fields (event:, id:) and keep-alive blank lines
        payload = "\n".join(self.data) if len(self.data) > 1 else self.data[0]
        self.data, self.size = [], 0
        if payload.strip() == "[DONE]":
            return _DONE
        try:
            obj = json.loads(payload)
        except ValueError:
            raise RetryableError(
                f"{self.endpoint} sent a malformed event: {server_text(payload, 200)!r}",
                endpoint=self.endpoint,
            ) from None
        return obj if isinstance(obj, dict) else _SKIP


def _closed_early(endpoint: str) -> RetryableError:
    return RetryableError(f"{endpoint} closed the stream before [DONE]", endpoint=endpoint)


def _stalled(endpoint: str, stall_timeout_s: float) -> StallError:
    return StallError(
        f"{endpoint} completed no event for {stall_timeout_s:g}s (stalled stream; comments, blank lines "
        "and unfinished events do not count as progress)",
        endpoint=endpoint,
    )


def _too_many(endpoint: str, events: int, max_events: int) -> ReplyTooLargeError:
    return ReplyTooLargeError(
        f"{endpoint} kept streaming past max_new_tokens ({events} events, at most {max_events} expected); cut",
        endpoint=endpoint,
    )


async def sse_events(
    lines: AsyncIterator[str],
    stall_timeout_s: float,
    endpoint: str,
    *,
    max_event_bytes: int | None = None,
    max_events: int | None = None,
) -> AsyncIterator[dict]:
    """JSON payloads of `data:` events until [DONE]; a stream that ends without [DONE] is retryable."""
    loop = asyncio.get_running_loop()
    it = lines.__aiter__()
    parser = _SSEParser(endpoint, max_event_bytes)
    deadline = loop.time() + stall_timeout_s
    events = 0
    while True:
        try:
            line = await asyncio.wait_for(it.__anext__(), max(0.0, deadline - loop.time()))
        except StopAsyncIteration:
            raise _closed_early(endpoint) from None
        except asyncio.TimeoutError:
            raise _stalled(endpoint, stall_timeout_s) from None
        event = parser.line(line)
        if event is None:
            continue
        if event is _DONE:
            return
        deadline = loop.time() + stall_timeout_s  # progress: an event completed
        events += 1
        if max_events is not None and events > max_events:
            raise _too_many(endpoint, events, max_events)
        if event is not _SKIP:
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
    max_event_bytes: int | None = None,
    max_events: int | None = None,
) -> None:
    """Feed every event of an SSE body (an aiohttp StreamReader) to `feed` until [DONE], then read the
    body to its end so that the keep-alive connection goes back to the pool instead of being closed.

    Lines end with LF or CRLF. A body that ends before [DONE] is retryable. The bounds (module
    docstring): no event for stall_timeout_s, one line or one event's data lines over
    max_event_bytes, more than max_events events."""
    loop = asyncio.get_running_loop()
    parser = _SSEParser(endpoint, max_event_bytes)
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
        if max_event_bytes is not None and len(tail) > max_event_bytes:
            raise ReplyTooLargeError(
                f"{endpoint} sent a stream line over max_reply_bytes ({max_event_bytes} bytes); cut",
                endpoint=endpoint,
            )
        for raw in parts:
            event = parser.line(raw.decode("utf-8", "replace").rstrip("\r"), len(raw))
            if event is None:
                continue
            if event is _DONE:
                await _drain(reader, loop)
                return
            deadline = loop.time() + stall_timeout_s  # progress: an event completed
            events += 1
            if max_events is not None and events > max_events:
                raise _too_many(endpoint, events, max_events)
            if event is not _SKIP:
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
