"""What a 2xx reply must look like before regen uses it, and how long a stream may run.

A reply of the wrong shape (not JSON, a list, a missing `finish_reason`, a number where text belongs)
is MalformedReplyError: retryable like any broken answer, so it is retried and, if it persists, the
ROW ends as retries_exhausted; it never escapes as an unclassified exception that fails a shard.
Parsing the API's fields is streams.py's job; sending and timing requests is endpoint.py's.
"""

from __future__ import annotations

import json

from regen_service.work.client.engines import completions_from_body
from regen_service.work.client.http import Completion, RetryableError
from regen_service.work.client.server_text import server_text
from regen_service.work.client.streams import chat_message_completion, generate_completion_from_body

# What reading a reply of the wrong shape raises (a list where a dict was due, a missing field...).
SHAPE_ERRORS = (ValueError, TypeError, AttributeError, KeyError, IndexError)


class MalformedReplyError(RetryableError):
    """A 2xx reply that is not the JSON object the API promises."""


def malformed(e: BaseException, endpoint: str) -> MalformedReplyError:
    return MalformedReplyError(
        f"{endpoint} sent a reply regen cannot read ({type(e).__name__}: {server_text(e, 200)})",
        endpoint=endpoint,
    )


def parse_reply(api: str, raw: bytes, endpoint: str) -> Completion:
    """A non-streaming 2xx body as a Completion, or MalformedReplyError."""
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise TypeError(f"a JSON {type(data).__name__}, not an object")
        if api == "generate":
            c = generate_completion_from_body(data, endpoint)
        elif api == "completions":
            c = completions_from_body(data, endpoint)
        else:
            c = chat_message_completion(data, endpoint)
        check_shape(c)
    except SHAPE_ERRORS as e:
        raise malformed(e, endpoint) from None
    return c


def check_shape(c: Completion) -> None:
    """Fields later code relies on, with the types it relies on (TypeError / KeyError otherwise)."""
    for name in ("text", "content", "reasoning_content"):
        value = getattr(c, name)
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} is a {type(value).__name__}, not a string")
    if c.output_ids is not None and not all(
        isinstance(i, int) and not isinstance(i, bool) for i in c.output_ids
    ):
        raise TypeError("output_ids holds something other than integers")
    for name in ("prompt_tokens", "completion_tokens"):
        value = getattr(c, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"{name} is a {type(value).__name__}, not an integer")
    if c.finish_reason is None:
        raise KeyError("finish_reason is missing")


def max_events(body: dict, slack: int) -> int | None:
    """The most stream events a request may get: its max_new_tokens plus slack (None: unknown)."""
    n = body.get("max_completion_tokens") or body.get("max_tokens")
    params = body.get("sampling_params")
    if n is None and isinstance(params, dict):
        n = params.get("max_new_tokens")
    return n + slack if isinstance(n, int) else None
