"""Hostile endpoints, round two (issue 18 items 3, 4, 6), each serving exactly the hostile input over
real HTTP (tests/work/hostile_endpoint.py, its own process):
- an API key quoted across the cut of an error text (500 characters of a body, 200 of an event) and a
  200 answer quoting it: no piece of the key reaches the Parquet rows or the worker's log;
- a stream that never ends an event, one that only sends `: keepalive`, one of events that are not
  objects: each is cut by its bound quickly, holding little memory;
- a 401 body that forges a log line: logged escaped, on one line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import tracemalloc
from pathlib import Path

import pytest

from regen_service.errors import RetriesExhaustedError
from regen_service.produce.producer import enqueue
from regen_service.work.client.auth import scrub_secrets
from regen_service.work.client.config import PoolConfig
from regen_service.work.client.http import ReplyTooLargeError, StallError
from regen_service.work.client.pool import EndpointPool
from tests.e2e.test_exactly_once import output_rows
from tests.procs import free_port, spawn, stop, wait_http, wait_run_done, worker_process
from tests.work.test_hostile_replies import prompt_mix

KEY = "sk-R2x9Qv7LmT4wP8zK3nB6yH"
PIECES = {KEY[i : i + 8] for i in range(len(KEY) - 7)}  # every 8-character piece of the key
MODEL = "moonshotai/Kimi-K2.5"
KIB = 1 << 10


@contextlib.contextmanager
def hostile_endpoint(mode: str, log: Path):
    port = free_port()
    cmd = [sys.executable, "-m", "tests.work.hostile_endpoint", "--port", str(port), "--mode", mode]
    proc = spawn(cmd, log=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", proc=proc)
        yield url
    finally:
        stop(proc)


def pieces_in(text: str) -> list[str]:
    return sorted(p for p in PIECES if p in text)


# --- item 3 and 6: the key, cut or quoted, and server text in logs -------------------------------
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
def test_a_key_quoted_across_a_cut_or_in_an_answer_never_reaches_rows_or_log(
    stream, settings, settings_env, tmp_path
):
    prompts = [
        "please straddle500",
        "please straddle503",
        "please straddle200",
        "please inject",
        "please echo",
    ]
    res = enqueue(settings, prompt_mix(tmp_path, f"quote{int(stream)}", [*prompts, "q 0", "q 1"]))
    env = {**settings_env, "REGEN_ENDPOINT_API_KEY": KEY, "REGEN_LOG_LEVEL": "DEBUG"}
    log = tmp_path / "worker.log"
    extra = ("--max-attempts", "2", *(() if stream else ("--no-stream",)))
    with (
        hostile_endpoint("quote", tmp_path / "fake.log") as url,
        worker_process(env, url, log=log, extra=extra) as w,
    ):
        wait_run_done(settings, res.run_id, procs=(w,), timeout_s=240)
    rows = {r["messages"][0]["content"]: r for r in output_rows(settings, res.run_id)}
    text, dump = log.read_text(), json.dumps(list(rows.values()), default=str)
    assert not pieces_in(dump) and not pieces_in(text), (pieces_in(dump), pieces_in(text))

    cut = rows["please straddle500"]
    assert cut["error_class"] == "terminal_row" and "p***" in cut["error"], cut["error"]
    assert "p*** overlo..." in rows["please straddle503"]["error"]  # scrubbed, then cut at 500
    if stream:
        assert "malformed event" in rows["please straddle200"]["error"]
        assert "q***" in rows["please straddle200"]["error"]
    # server text with CR/LF/ESC is stored escaped, and logged on one line
    injected = rows["please inject"]["error"]
    assert "overloaded\\r\\n[INFO] shard run/0 done\\x1b[2K" in injected, injected
    assert not any(c in injected for c in "\r\n\x1b")
    assert not any(line.startswith("[INFO] shard") for line in text.splitlines())
    # an answer quoting the key is stored with *** in its place (content, reasoning, tool-call args)
    echo = rows["please echo"]
    assert echo["error"] is None, echo["error"]
    answer = echo["messages"][-1]
    assert answer["content"] == "your key is ***, keep it" and answer["reasoning_content"] == "they sent ***"
    assert json.loads(answer["tool_calls"][0]["arguments"]) == {"k": "***"}
    assert "answered with text that quotes the API key" in text
    assert all(rows[f"q {i}"]["error"] is None for i in range(2))


def test_a_401_body_that_forges_a_log_line_is_logged_escaped_on_one_line(settings, settings_env, tmp_path):
    enqueue(settings, prompt_mix(tmp_path, "forge", ["question 0", "question 1"]))
    env = {**settings_env, "REGEN_ENDPOINT_API_KEY": KEY}
    log = tmp_path / "worker.log"
    with hostile_endpoint("deny", tmp_path / "fake.log") as url, worker_process(env, url, log=log) as w:
        deadline = time.monotonic() + 120
        while "stopping consumption" not in log.read_text():
            assert w.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
    lines = log.read_text().splitlines()
    stopped = [line for line in lines if " stopped: " in line]
    assert len(stopped) == 1 and "(401 bad key\\r\\n[INFO] shard run/0 done\\x1b[2K)" in stopped[0], stopped
    # every other line that repeats it (Celery's reject, as a repr) holds it on the same line too
    assert all("n[INFO] shard run/0 done" in line for line in lines if "shard run/0 done" in line)
    assert not any(line.startswith("[INFO] shard") for line in lines)
    assert "\x1b" not in log.read_text() and not pieces_in(log.read_text())


def test_scrubbing_a_whole_error_body_before_the_cut_stays_linear():
    # Scrubbing before the cut means scrubbing up to max_reply_bytes: the URL-credentials pattern must
    # not backtrack over a long run of letters (it took minutes on 1 MiB before its scheme was bounded).
    body = "a" * (1 << 20) + " http://user:S3cret@host/ " + "b" * (1 << 20)
    t0 = time.monotonic()
    out = scrub_secrets(body)
    assert "http://user:***@host/" in out and "S3cret" not in out
    assert time.monotonic() - t0 < 10


# --- item 4: streams that never end an event, never progress, or never stop --------------------
async def _complete(url: str, **cfg) -> tuple[BaseException, float, int]:
    """One chat request through a real pool (one attempt): the error it ended with, the seconds it
    took, and the peak bytes Python held (tracemalloc) while it ran."""
    config = PoolConfig(endpoints=[url], max_attempts=1, request_timeout_s=30, **cfg)
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 64}
    async with EndpointPool(config, MODEL) as pool:
        tracemalloc.start()
        t0 = time.monotonic()
        try:
            with pytest.raises(RetriesExhaustedError) as info:
                await pool.complete("chat", payload)
        finally:
            took, peak = time.monotonic() - t0, tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    return info.value.__cause__, took, peak


def test_a_stream_that_never_ends_an_event_is_cut_at_the_event_bound(tmp_path):
    with hostile_endpoint("nodelim", tmp_path / "fake.log") as url:
        cause, took, peak = asyncio.run(_complete(url, max_reply_bytes=64 * KIB))
    assert isinstance(cause, ReplyTooLargeError), cause
    assert "stream event over max_reply_bytes (65536 bytes" in str(cause)
    assert "without the blank line that ends an event" in str(cause)
    print(f"cut after {took:.2f}s holding at most {peak / KIB:.0f} KiB")
    assert took < 10 and peak < 2048 * KIB


def test_keepalive_comments_forever_end_at_the_stall_timeout(tmp_path):
    with hostile_endpoint("keepalive", tmp_path / "fake.log") as url:
        cause, took, _ = asyncio.run(_complete(url, stall_timeout_s=2.0))
    assert isinstance(cause, StallError) and "completed no event for 2s" in str(cause), cause
    assert 1.9 <= took < 6, took  # the stall timeout, not request_timeout_s (30)


def test_events_that_are_not_objects_count_toward_the_event_bound(tmp_path):
    with hostile_endpoint("nondict", tmp_path / "fake.log") as url:
        cause, took, _ = asyncio.run(_complete(url, stall_timeout_s=2.0))
    assert isinstance(cause, ReplyTooLargeError) and "kept streaming past max_new_tokens" in str(cause), cause
    assert took < 10
