"""Exactly once under crashes: leases, takeover, resume after a Redis wipe, and the chaos run.

Real processes throughout: Celery workers killed with SIGKILL, the ledger's keys deleted mid-run, the
simulator counting every request it is asked, outputs read back from Parquet.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
import redis
import yaml

from regen_service.produce.producer import enqueue
from regen_service.settings import Settings
from regen_service.state.ledger import Ledger
from regen_service.state.status import run_status
from tests.procs import regen_cmd, sim_server, spawn, stop, wait_run_done, worker_process

VOLATILE = {"ttft_s", "decode_tok_s", "latency_s", "endpoint", "attempts"}


def write_prompt_mix(tmp_path: Path, name: str, num_prompts: int, shard_size: int) -> Path:
    data = tmp_path / f"{name}.jsonl"
    with data.open("w") as f:
        for i in range(num_prompts):
            f.write(json.dumps({"prompt": f"question {i}: explain item {i * 7919 % 10007} briefly"}) + "\n")
    mix = tmp_path / f"{name}.yaml"
    mix.write_text(yaml.safe_dump({
        "name": name, "target": {"model": "moonshotai/Kimi-K2.5", "api": "chat"},
        "sampling": {"max_new_tokens": 64}, "shard_size": shard_size,
        "sources": [{"name": "prompts", "path": str(data), "format": "prompt_response"}],
    }))  # fmt: skip
    return mix


def output_rows(settings: Settings, run_id: str) -> list[dict]:
    root = Path(settings.data_root_resolved) / "runs" / run_id / "outputs"
    rows = []
    for f in sorted(root.glob("shard-*.parquet")):
        rows += pq.read_table(f).to_pylist()
    return rows


def comparable(row: dict) -> dict:
    turns = [{k: v for k, v in t.items() if k not in VOLATILE} for t in row["turns"]]
    keep = {k: v for k, v in row.items() if k not in VOLATILE | {"turns", "run_id"}}
    return {**keep, "turns": turns}


def sim_stats(url: str) -> dict:
    return httpx.get(f"{url}/sim/stats", timeout=5).json()


def wipe(settings: Settings) -> int:
    r = redis.Redis.from_url(settings.redis_url)
    keys = list(r.scan_iter(f"{settings.key_prefix}*"))
    return r.delete(*keys) if keys else 0


def test_takeover_after_holder_dies(settings, settings_env, tmp_path):
    """A shard whose lease is held by a dead holder is taken over once the lease expires, not before."""
    mix = write_prompt_mix(tmp_path, "takeover", 40, 20)
    res = enqueue(settings, mix)
    ledger = Ledger(settings)
    assert ledger.acquire_lease(res.run_id, 0, "ghost-worker")  # a holder that never heartbeats
    t0 = time.monotonic()
    with (
        sim_server("--decode-tok-s", "0") as url,
        worker_process(settings_env, url, log=tmp_path / "w.log") as w,
    ):
        wait_run_done(settings, res.run_id, procs=(w,), timeout_s=60)
        stats = sim_stats(url)
    assert time.monotonic() - t0 >= settings.lease_ttl_s * 0.8  # shard 0 waited for the ghost's lease
    rows = output_rows(settings, res.run_id)
    assert len(rows) == len({r["prompt_id"] for r in rows}) == 40
    assert stats["requests_total"] == 40


def test_duplicate_delivery_is_not_run_twice(settings, settings_env, tmp_path):
    """The same shard delivered to two live workers at once: one runs it, the other waits; no prompt asked twice."""
    from regen_service.state.queue import make_celery, send_shard

    mix = write_prompt_mix(tmp_path, "dupes", 60, 60)
    res = enqueue(settings, mix)
    app = make_celery(settings)
    send_shard(app, res.run_id, 0)  # a duplicate message, as a visibility-timeout redelivery would make
    sim = ("--decode-tok-s", "20", "--answer-len-mean", "30", "--max-running-requests", "8")
    w1_args = {"log": tmp_path / "w1.log", "extra": ("--hostname", "w1@t")}
    w2_args = {"log": tmp_path / "w2.log", "extra": ("--hostname", "w2@t")}
    with (
        sim_server(*sim) as url,
        worker_process(settings_env, url, **w1_args) as w1,
        worker_process(settings_env, url, **w2_args) as w2,
    ):
        wait_run_done(settings, res.run_id, procs=(w1, w2), timeout_s=90)
        stats = sim_stats(url)
    rows = output_rows(settings, res.run_id)
    assert len(rows) == len({r["prompt_id"] for r in rows}) == 60
    assert stats["requests_total"] == 60


def test_resume_after_redis_wipe(settings, settings_env, tmp_path):
    mix = write_prompt_mix(tmp_path, "wiped", 200, 20)
    res = enqueue(settings, mix)
    sim = ("--decode-tok-s", "50", "--answer-len-mean", "20", "--max-running-requests", "16")
    with sim_server(*sim) as url:
        with worker_process(settings_env, url, log=tmp_path / "w1.log") as w:
            deadline = time.monotonic() + 60
            while run_status(Ledger(settings), res.run_id)["shards_done"] < 3 and time.monotonic() < deadline:
                time.sleep(0.2)
            w.send_signal(signal.SIGKILL)
            w.wait()
        assert wipe(settings) > 0
        assert Ledger(settings).run_record(res.run_id) is None
        env = {**os.environ, **settings_env}
        for _ in range(2):  # safe to run any number of times
            out = subprocess.run(
                regen_cmd("resume", res.run_id, "--json"), env=env, capture_output=True, text=True
            )
            assert out.returncode == 0, out.stderr
        first = json.loads(out.stdout)
        assert first["shards_done"] >= 3
        with worker_process(settings_env, url, log=tmp_path / "w2.log") as w:
            st = wait_run_done(settings, res.run_id, procs=(w,), timeout_s=90)
    rows = output_rows(settings, res.run_id)
    assert len(rows) == len({r["prompt_id"] for r in rows}) == 200 == st["prompts_done"]


@pytest.mark.slow
def test_chaos_kills_and_wipe_exactly_once(settings, settings_env, tmp_path, redis_available):
    """>= 2,000 prompts; workers SIGKILLed three times at random moments; Redis wiped once, then resume.

    Every prompt ends in the outputs exactly once, each row equal to an uninterrupted run's, and the
    prompts asked twice are no more than the requests in flight at the kills and the wipe.
    """
    num_prompts = 2000
    rng = random.Random(int(os.environ.get("REGEN_CHAOS_SEED", "7")))
    mix = write_prompt_mix(tmp_path, "chaos", num_prompts, 50)
    env = {**os.environ, **settings_env}
    logs = tmp_path / "logs"
    logs.mkdir()
    sim_args = (
        "--decode-tok-s",
        "30",
        "--answer-len-mean",
        "20",
        "--max-running-requests",
        "48",
        "--seed",
        "3",
    )
    res = enqueue(settings, mix)
    in_flight_at_faults = 0
    with sim_server(*sim_args, log=logs / "sim.log") as url:
        workers = [
            spawn(
                regen_cmd("worker", "--endpoint", url, "--hostname", f"c{i}@t"),
                env=env,
                log=logs / f"w{i}.log",
            )
            for i in range(2)
        ]
        faults = ["kill", "kill", "wipe", "kill"]
        try:
            for n, fault in enumerate(faults):
                time.sleep(rng.uniform(3.0, 8.0))
                st = sim_stats(url)
                in_flight_at_faults += st["running"] + st["queued"]
                if fault == "kill":
                    i = rng.randrange(len(workers))
                    workers[i].send_signal(signal.SIGKILL)
                    workers[i].wait()
                    workers[i] = spawn(
                        regen_cmd("worker", "--endpoint", url, "--hostname", f"c{i}-{n}@t"),
                        env=env,
                        log=logs / f"w{i}-{n}.log",
                    )
                    time.sleep(settings.lease_ttl_s + 1)  # the dead holder's leases expire
                else:
                    wipe(settings)
                out = subprocess.run(regen_cmd("resume", res.run_id), env=env, capture_output=True, text=True)
                assert out.returncode == 0, out.stderr
            wait_run_done(settings, res.run_id, procs=tuple(workers), timeout_s=240)
            stats = sim_stats(url)
        finally:
            for w in workers:
                stop(w)
    rows = output_rows(settings, res.run_id)
    assert len(rows) == num_prompts
    assert len({r["prompt_id"] for r in rows}) == num_prompts
    asked_twice = stats["requests_total"] - num_prompts
    print(
        f"chaos: {num_prompts} prompts, asked twice {asked_twice}, in flight at the faults {in_flight_at_faults}"
    )
    assert 0 <= asked_twice <= in_flight_at_faults, (asked_twice, in_flight_at_faults)

    # the reference: the same mix, uninterrupted, against a simulator with the same seed
    ref_settings = settings.model_copy(
        update={"key_prefix": settings.key_prefix + "-ref", "data_root": str(tmp_path / "ref")}
    )
    ref_env = {
        **settings_env,
        "REGEN_KEY_PREFIX": ref_settings.key_prefix,
        "REGEN_DATA_ROOT": ref_settings.data_root,
    }
    ref = enqueue(ref_settings, mix)
    ref_sim = ("--decode-tok-s", "0", "--answer-len-mean", "20", "--seed", "3")  # same answers, no delay
    with sim_server(*ref_sim) as url, worker_process(ref_env, url) as w:
        wait_run_done(ref_settings, ref.run_id, procs=(w,), timeout_s=120)
    ref_rows = {r["prompt_id"]: comparable(r) for r in output_rows(ref_settings, ref.run_id)}
    assert {r["prompt_id"]: comparable(r) for r in rows} == ref_rows
    wipe(ref_settings)
