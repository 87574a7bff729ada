"""What one request attempt produced, and how SGLang's HTTP answers map onto regen's error types.

Classification is by status code and by the shape of the payload, never by message text:
  2xx                         -> parse the body
  401 / 403                   -> EndpointTerminalError (the key is wrong: stop using the endpoint)
  408, 429, 5xx               -> RetryableError (503 "queue full", timeouts, overload)
  other 4xx                   -> RowTerminalError (context length, bad request: never retried)
An error object inside a 200 body or stream event follows its `code` / `status_code` the same way;
one with no code at all is `UncodedStreamError` (retryable; the pool re-sends it without streaming so
that SGLang reports the failure with a real status code; see pool.py). Parsing streams is sse.py's and streams.py's job.

Transport: one aiohttp `ClientSession` per endpoint and purpose (`make_session`), HTTP/1.1 keep-alive,
its connector sized to the in-flight limit so every outstanding request has its own socket and no
request waits for a connection.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import aiohttp

from regen_service.errors import EndpointTerminalError, RetryableError, RowTerminalError
from regen_service.work.client.server_text import server_text
from schemas.conversation import ToolCall


class UncodedStreamError(RetryableError):
    """An in-stream error event without any status code (SGLang's native /generate stream does this)."""


class ConnectionRefusedRetryable(RetryableError):
    """The endpoint refused the connection: retry elsewhere and eject it at once."""


class StallError(RetryableError):
    """No byte arrived for stall_timeout_s while streaming."""


class ReplyTooLargeError(RetryableError):
    """A reply body, error body or stream line over max_reply_bytes, or a stream that kept sending
    past max_new_tokens + stream_slack_events: cut before it can exhaust the worker's memory."""


async def read_limited(resp: aiohttp.ClientResponse, limit: int, endpoint: str) -> bytes:
    """The whole body, or ReplyTooLargeError as soon as it is known to exceed `limit` bytes."""
    if resp.content_length is not None and resp.content_length > limit:
        raise ReplyTooLargeError(
            f"{endpoint} announced a {resp.content_length}-byte reply (max_reply_bytes {limit})",
            endpoint=endpoint,
        )
    chunks, size = [], 0  # joined once at the end: no reallocation copies of a growing buffer
    while chunk := await resp.content.read(1 << 16):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise ReplyTooLargeError(
                f"{endpoint} sent a reply over max_reply_bytes ({limit} bytes); cut", endpoint=endpoint
            )
    return b"".join(chunks)


class StreamModeError(RetryableError):
    """A /generate stream that fits neither totals nor deltas as announced (the server's stream mode is
    not what the endpoint believed): the endpoint falls back to detecting it, and the request is retried."""


@dataclass
class Completion:
    """One answered request, as the server sent it (text raw; output_ids untouched)."""

    text: str = ""
    content: str | None = None  # set when the server separated reasoning (chat API)
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    output_ids: list[int] | None = None
    finish_reason: str | None = None
    matched_stop: object = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_s: float | None = None
    decode_tok_s: float | None = None
    latency_s: float = 0.0
    endpoint: str = ""
    attempts: int = 1
    meta: dict = field(default_factory=dict)


def status_error(status: int, detail: str, endpoint: str) -> Exception:
    """The regen error for a non-2xx status (or an in-body error code); the server's text scrubbed,
    cut and escaped (server_text: idempotent, so a detail cleaned by the caller is unchanged)."""
    detail = server_text(detail)
    msg = f"{endpoint} answered {status}: {detail}"
    if status in (401, 403):
        return EndpointTerminalError(
            f"{endpoint} rejected the request ({status} {detail}); check the API key", endpoint=endpoint
        )
    if status in (408, 429) or status >= 500:
        return RetryableError(msg, status_code=status, endpoint=endpoint)
    if 400 <= status < 500:
        return RowTerminalError(msg, status_code=status)
    return RetryableError(msg, status_code=status, endpoint=endpoint)


def error_detail(body: bytes | str) -> str:
    """The human message inside an SGLang error body ({"error": {...}}, {"message": ...} or text),
    scrubbed of secrets before it is cut (server_text)."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except ValueError:
        return server_text(text.strip()) or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return server_text(err.get("message") or err)
        return server_text(err)
    return server_text(text.strip())


def raise_for_status(status: int, body: bytes, endpoint: str) -> None:
    if 200 <= status < 300:
        return
    raise status_error(status, error_detail(body), endpoint)


def error_code(err: dict) -> int | None:
    for key in ("code", "status_code"):
        value = err.get(key)
        if isinstance(value, int):
            return value
        if isinstance(value, str) and value.isdigit():
            return int(value)
    return None


def event_error(err: object, endpoint: str) -> Exception:
    """The regen error for an `{"error": ...}` object found in a 200 body or a stream event."""
    if not isinstance(err, dict):
        return UncodedStreamError(f"{endpoint} sent an error event: {server_text(err)}", endpoint=endpoint)
    code = error_code(err)
    detail = server_text(err.get("message") or err)
    if code is None:
        return UncodedStreamError(
            f"{endpoint} sent an error event without a code: {detail}", endpoint=endpoint
        )
    return status_error(code, detail, endpoint)


def check_abort(finish_reason: object, endpoint: str) -> None:
    """A native `finish_reason` of type abort is a failure: 4xx status terminal for the row, else retry."""
    if not isinstance(finish_reason, dict) or finish_reason.get("type") != "abort":
        return
    code = error_code(finish_reason)
    detail = server_text(finish_reason.get("message") or "aborted")
    if code is not None and 400 <= code < 500:
        raise status_error(code, f"request aborted: {detail}", endpoint)
    raise RetryableError(
        f"{endpoint} aborted the request ({code}): {detail}", status_code=code, endpoint=endpoint
    )


def finish_type(finish_reason: object) -> str | None:
    """Native finish_reason dicts and OpenAI strings, as one string (stop | length | tool_calls | abort)."""
    if finish_reason is None:
        return None
    if isinstance(finish_reason, dict):
        return str(finish_reason.get("type"))
    return str(finish_reason)


# Idle keep-alive sockets are closed after this long (an idle endpoint holds no sockets forever).
KEEPALIVE_S = 60.0


def dump_body(body: dict) -> bytes:
    """A request body as compact UTF-8 JSON (what httpx's `json=` sent; NaN is refused)."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def make_session(
    headers: dict, *, connections: int, connect_s: float, read_s: float | None
) -> aiohttp.ClientSession:
    """An HTTP/1.1 keep-alive session whose connector holds at most `connections` sockets (the in-flight
    limit). `connect_s` bounds opening a socket, `read_s` the silence between two reads of a response
    (None: no limit); waiting for a free socket is not bounded (the pool never lets that happen)."""
    connector = aiohttp.TCPConnector(
        limit=connections, limit_per_host=0, keepalive_timeout=KEEPALIVE_S, ttl_dns_cache=300
    )
    timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=connect_s, sock_read=read_s)
    return aiohttp.ClientSession(
        headers=headers, connector=connector, timeout=timeout, raise_for_status=False, trust_env=False
    )
