"""The endpoint pool against the simulator as a real process, one test per fault class.

Each run ends with every prompt either answered once or recorded as a terminal error with its reason.
Shared helpers (mix, records, running a batch the way the worker does) live here and are imported by
test_regenerate.py.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from pydantic import SecretStr

from regen_service.errors import EndpointTerminalError
from regen_service.work.client.config import PoolConfig
from regen_service.work.client.pool import EndpointPool
from regen_service.work.regenerate import Regenerator
from schemas.conversation import Conversation, Message, PromptRecord
from schemas.mix import MixSpec
from tests.procs import sim_server

MODEL = "moonshotai/Kimi-K2.5"
FAST = ("--answer-len-mean", "24", "--answer-len-max", "64", "--seed", "7")


def make_mix(
    api: str = "chat", turns: str = "all", thinking: str = "keep", tokenizer: str | None = None
) -> MixSpec:
    return MixSpec.model_validate(
        {
            "name": "t",
            "target": {"model": MODEL, "api": api, "tokenizer": tokenizer},
            "sampling": {"max_new_tokens": 256},
            "regenerate": {"turns": turns, "thinking": thinking},
            "sources": [{"name": "s", "path": "x.jsonl", "format": "messages"}],
        }
    )


def make_record(i: int, messages: list[Message], tools=None) -> PromptRecord:
    conv = Conversation(messages=tuple(messages), tools=tools)
    return PromptRecord(prompt_id=f"p{i:05d}", source="s", row_index=i, conversation=conv)


def simple_records(n: int, words: int = 6) -> list[PromptRecord]:
    return [
        make_record(i, [Message(role="user", content=f"question {i} " + "word " * words)]) for i in range(n)
    ]


def fast_config(urls: list[str], **kw) -> PoolConfig:
    base = {
        "endpoints": urls,
        "backoff_initial_s": 0.05,
        "backoff_max_s": 1.0,
        "backoff_jitter_s": 0.05,
        "breaker_probe_initial_s": 0.2,
        "breaker_probe_max_s": 1.0,
        "stall_timeout_s": 5.0,
    }
    return PoolConfig(**(base | kw))


async def run_batch(pool: EndpointPool, regen: Regenerator, records: list[PromptRecord]) -> list[dict]:
    """What the worker does: keep pool.inflight_target rows outstanding until all are done; each row
    as the shard stores it (OutputRow.to_record)."""
    rows: list[dict | None] = [None] * len(records)
    queue = list(enumerate(records))

    async def lane() -> None:
        while queue:
            i, rec = queue.pop()
            rows[i] = (await regen.regenerate(rec)).to_record()

    await asyncio.gather(*(lane() for _ in range(min(pool.inflight_target, len(records)))))
    return rows


async def regenerate_all(urls: list[str], records, mix: MixSpec | None = None, tokenizer=None, **cfg):
    mix = mix or make_mix()
    async with EndpointPool(fast_config(urls, **cfg), MODEL) as pool:
        rows = await run_batch(pool, Regenerator(pool, mix, tokenizer), records)
        return rows, pool.snapshot()


def sim_stats(url: str, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{url}/sim/stats", headers=headers).json()


def assert_all_answered(rows: list[dict], n: int) -> None:
    assert len(rows) == n and len({r["prompt_id"] for r in rows}) == n
    bad = [(r["prompt_id"], r["error_class"], r["error"]) for r in rows if r["error"]]
    assert not bad, bad
    assert all(len(r["turns"]) == 1 and r["messages"][-1]["role"] == "assistant" for r in rows)


def answers(rows: list[dict]) -> dict[str, tuple]:
    return {
        r["prompt_id"]: (r["messages"][-1]["content"], r["messages"][-1]["reasoning_content"]) for r in rows
    }


def test_503_bursts_are_retried_and_nothing_is_lost():
    records = simple_records(60)
    with sim_server(*FAST, "--decode-tok-s", "0", "--fault-503-rate", "0.3") as url:
        # 12 attempts: 0.3**12 per prompt, so no prompt runs out of attempts by chance
        rows, snap = asyncio.run(regenerate_all([url], records, max_attempts=12))
        stats = sim_stats(url)
    assert_all_answered(rows, 60)
    assert stats["num_503"] > 0 and snap["endpoints"][0]["errors"]["retryable"] == stats["num_503"]
    assert stats["completed"] == 60  # each prompt answered exactly once
    assert max(r["attempts"] for r in rows) > 1


def test_mid_stream_disconnects_and_error_events_keep_exact_answers():
    records = simple_records(40)
    faults = (
        "--fault-disconnect-rate",
        "0.3",
        "--fault-error-event-rate",
        "0.1",
        "--fault-abort-rate",
        "0.1",
    )
    with (
        sim_server(*FAST, "--decode-tok-s", "2000") as clean,
        sim_server(*FAST, "--decode-tok-s", "2000", *faults) as bad,
    ):
        ref, _ = asyncio.run(regenerate_all([clean], records))
        rows, _ = asyncio.run(regenerate_all([bad], records, max_attempts=12))
        stats = sim_stats(bad)
    assert_all_answered(rows, 40)
    assert stats["num_disconnects_injected"] > 0 and stats["num_aborts_injected"] > 0
    assert answers(rows) == answers(ref)  # the same deterministic answers as a fault-free run


def test_stalled_streams_are_cut_and_retried():
    records = simple_records(20)
    with sim_server(*FAST, "--decode-tok-s", "500", "--fault-stall-rate", "0.3", "--stall-s", "30") as url:
        rows, _ = asyncio.run(
            regenerate_all([url], records, stall_timeout_s=0.5, breaker_failure_threshold=50)
        )
        stats = sim_stats(url)
    assert_all_answered(rows, 20)
    assert stats["num_stalls_injected"] > 0
    assert max(r["latency_s"] for r in rows) < 15  # never waited out a 30 s stall


def test_server_that_dies_mid_run_and_comes_back():
    records = simple_records(80)

    async def scenario(url: str):
        async with EndpointPool(fast_config([url]), MODEL) as pool:
            task = asyncio.create_task(run_batch(pool, Regenerator(pool, make_mix()), records))
            await asyncio.sleep(0.5)
            async with httpx.AsyncClient() as c:
                await c.post(f"{url}/sim/outage", json={"duration_s": 2.0})
            await asyncio.sleep(0.6)
            during = pool.snapshot()["endpoints"][0]
            rows = await task
            return rows, during, pool.snapshot()["endpoints"][0]

    with sim_server(*FAST, "--decode-tok-s", "40", "--max-running-requests", "16") as url:
        rows, during, after = asyncio.run(scenario(url))
    assert_all_answered(rows, 80)
    assert during["ejected"] and not after["ejected"] and after["healthy"]
    assert max(r["attempts"] for r in rows) > 1


def test_failover_to_a_live_endpoint_during_an_outage():
    records = simple_records(60)

    async def scenario(a: str, b: str):
        async with EndpointPool(fast_config([a, b]), MODEL) as pool:
            async with httpx.AsyncClient() as c:
                await c.post(f"{a}/sim/outage", json={"duration_s": 30.0})
            await asyncio.sleep(0.2)
            return await run_batch(pool, Regenerator(pool, make_mix()), records)

    with sim_server(*FAST, "--decode-tok-s", "200") as a, sim_server(*FAST, "--decode-tok-s", "200") as b:
        rows = asyncio.run(scenario(a, b))
        assert sim_stats(b)["completed"] >= 55
    assert_all_answered(rows, 60)


def test_wrong_model_refuses_to_start():
    with (
        sim_server(*FAST, "--model", "other-org/Other-Model") as url,
        pytest.raises(EndpointTerminalError) as err,
    ):
        asyncio.run(regenerate_all([url], simple_records(1)))
    assert "other-org/Other-Model" in str(err.value) and MODEL in str(err.value)


def test_401_stops_that_endpoint_and_never_logs_the_key(caplog):
    caplog.set_level(logging.DEBUG)
    key = "sk-regen-test-7f3a9c"
    with (
        sim_server(*FAST, "--decode-tok-s", "0", "--api-key", key) as good,
        sim_server(*FAST, "--decode-tok-s", "0", "--api-key", "some-other-key") as bad,
    ):
        rows, snap = asyncio.run(regenerate_all([good, bad], simple_records(20), api_key=SecretStr(key)))
        assert sim_stats(good, key)["completed"] == 20
    assert_all_answered(rows, 20)
    stopped = {e["url"]: e["stopped"] for e in snap["endpoints"]}
    assert stopped[good] is None and "401" in stopped[bad] and "API key" in stopped[bad]
    assert any("401" in r.getMessage() for r in caplog.records)
    assert key not in caplog.text and key not in str(snap)


@pytest.mark.parametrize("api", ["chat", "generate"])
def test_prompt_longer_than_context_is_terminal_and_never_retried(api, tmp_path):
    from transformers import AutoTokenizer

    from tests.work.test_client_units import DEMO_TOKENIZER

    tok = AutoTokenizer.from_pretrained(str(DEMO_TOKENIZER)) if api == "generate" else None
    long = [make_record(100 + i, [Message(role="user", content="word " * 400)]) for i in range(3)]
    records = simple_records(5, words=2) + long
    mix = make_mix(api=api, tokenizer=str(DEMO_TOKENIZER) if tok else None)
    with sim_server(
        *FAST, "--decode-tok-s", "0", "--context-length", "200", "--tokenizer", str(DEMO_TOKENIZER)
    ) as url:
        rows, _ = asyncio.run(regenerate_all([url], records, mix=mix, tokenizer=tok))
        stats = sim_stats(url)
    by_id = {r["prompt_id"]: r for r in rows}
    for rec in long:
        row = by_id[rec.prompt_id]
        assert row["error_class"] == "terminal_row" and "context length" in row["error"]
        assert row["turns"] == [] and row["attempts"] == 0
    assert_all_answered([by_id[r.prompt_id] for r in records[:5]], 5)
    # generate: refused client side from the reported context length; chat: one real 400 each
    assert stats["num_context_errors"] == (0 if api == "generate" else 3)
    assert stats["completed"] == 5


def test_uncoded_native_stream_error_becomes_terminal_via_a_non_streaming_retry(tmp_path):
    """Without the server's limits, SGLang's context error arrives as an uncoded stream event."""
    from transformers import AutoTokenizer

    from tests.work.test_client_units import DEMO_TOKENIZER

    tok = AutoTokenizer.from_pretrained(str(DEMO_TOKENIZER))
    rec = make_record(0, [Message(role="user", content="word " * 400)])
    mix = make_mix(api="generate", tokenizer=str(DEMO_TOKENIZER))
    with sim_server(*FAST, "--context-length", "200", "--tokenizer", str(DEMO_TOKENIZER)) as url:
        rows, _ = asyncio.run(
            regenerate_all([url], [rec], mix=mix, tokenizer=tok, health_check_on_start=False)
        )
        stats = sim_stats(url)
    assert rows[0]["error_class"] == "terminal_row"
    assert stats["num_context_errors"] == 2  # the stream, then one non-streaming attempt with a real 400
