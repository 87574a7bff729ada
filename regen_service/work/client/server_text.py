"""Text a server sent, made safe before regen keeps it: in an error, a log line, or an answer's row.

`server_text` is the one way server text (an error body, an event payload, an exception's message)
enters an error message or a log line: every secret scrubbed FIRST, on the whole text, then cut, then
control characters escaped. Cutting first would keep the first characters of a key that straddles the
cut; escaping keeps a body's newlines and terminal escapes from forging log lines (a 401 body saying
"\\n[INFO] shard run/0 done" stays on its own, one line). The escape leaves backslashes alone, so it is
idempotent: a sink may apply it again to text a source already cleaned.

`redact_answer` applies the same scrub to a 2xx answer (text, content, reasoning, tool calls): a server
(or a proxy) that quotes the API key back must not put it into the training data. Only registered keys
are replaced there, never URL credentials, which an answer may legitimately show. Answers with token ids
(api generate) cannot be edited without breaking their exactness: they are refused (retryable).

A key broken up on purpose by the server (characters inserted, encoded) is beyond any scrubber: the
scrub works on assembled text (a whole body, an event's joined data lines, an answer's joined deltas),
never on pieces, so a key split across TCP chunks, SSE lines or stream deltas is still found whole.
What a key is and where it comes from is auth.py's job.
"""

from __future__ import annotations

import logging
import re
from typing import Protocol

from regen_service.errors import RetryableError
from regen_service.work.client import metrics
from regen_service.work.client.auth import MARKER, scrub_registered, scrub_secrets


class Answer(Protocol):
    """The fields of http.Completion an answer's scrub rewrites (http.py imports this module, not back)."""

    text: str
    content: str | None
    reasoning_content: str | None
    finish_reason: str | None
    matched_stop: object
    tool_calls: list | None
    output_ids: list | None


log = logging.getLogger(__name__)

# C0/C1 controls (newline, carriage return, ESC...), Unicode line and paragraph separators (which
# str.splitlines and some log viewers break on) and bidi overrides (which reorder what a reader sees).
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}

# How much of a server's text an error keeps (after scrubbing; the escapes may lengthen it).
ERROR_CHARS = 500


def _escape(m: re.Match) -> str:
    ch = m.group()
    return _NAMED.get(ch) or (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")


def escape_controls(text: str) -> str:
    """`text` on one line: every control character as a visible escape (\\n, \\r, \\x1b, \\u2028)."""
    return _CONTROLS.sub(_escape, text)


def server_text(text: object, limit: int | None = ERROR_CHARS) -> str:
    """Server-provided text fit for an error or a log line: scrubbed whole, then cut to `limit`
    characters (None: not cut), then escaped."""
    text = scrub_secrets(str(text))
    if limit is not None and len(text) > limit:
        text = text[:limit] + "..."
    # scrubbed again: an escape could spell a key that holds a backslash sequence (cheap: text is short)
    return scrub_secrets(escape_controls(text))


class SecretInAnswerError(RetryableError):
    """A token-exact answer (output ids) that quotes the API key: its ids cannot be scrubbed, so it is
    not stored; another attempt (possibly another endpoint) may answer cleanly."""


def redact_answer(c: Answer, endpoint: str) -> int:
    """Replace every registered secret in the answer's stored fields by MARKER; the number replaced.
    Counted (regen_client_answers_scrubbed_total) and logged without the key."""
    found = 0

    def clean(value):
        nonlocal found
        if not isinstance(value, str):
            return value
        value, n = scrub_registered(value)
        found += n
        return value

    c.text, c.content, c.reasoning_content = clean(c.text), clean(c.content), clean(c.reasoning_content)
    c.finish_reason, c.matched_stop = clean(c.finish_reason), clean(c.matched_stop)
    if c.tool_calls:
        c.tool_calls = [
            tc.model_copy(
                update={"id": clean(tc.id), "name": clean(tc.name), "arguments": clean(tc.arguments)}
            )
            for tc in c.tool_calls
        ]
    if not found:
        return 0
    metrics.ANSWERS_SCRUBBED.labels(endpoint).inc()
    if c.output_ids is not None:
        raise SecretInAnswerError(
            f"{endpoint} answered with text that quotes the API key; its token ids cannot be scrubbed "
            "(api generate keeps them exact), so the answer is not stored",
            endpoint=endpoint,
        )
    log.warning(
        "%s answered with text that quotes the API key (%d time(s)); stored with %s in its place",
        endpoint,
        found,
        MARKER,
    )
    return found
