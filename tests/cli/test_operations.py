"""The operator's view and the safety rails: Flower behind auth showing shard tasks, Prometheus metrics,
secrets kept out of logs and status, and a corpus of bad input that never stops a run."""

from __future__ import annotations

import json
import os
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
from tests.e2e.test_exactly_once import output_rows, write_prompt_mix
from tests.procs import (
    free_port,
    regen_cmd,
    sim_server,
    spawn,
    stop,
    wait_http,
    wait_run_done,
    worker_process,
)

REDIS_PASSWORD = "r3dis-S3CRET-pw"
API_KEY = "sk-endpoint-S3CRET-key"


@pytest.fixture
def private_redis(tmp_path):
    """A password-protected Redis of the test's own, on a free port."""
    port = free_port()
    proc = spawn(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--requirepass", REDIS_PASSWORD,
                  "--save", "", "--appendonly", "no", "--dir", str(tmp_path)])  # fmt: skip
    url = f"redis://:{REDIS_PASSWORD}@127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.RedisError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    yield url
    stop(proc)


def test_secrets_stay_out_of_logs_status_and_flower(private_redis, tmp_path):
    settings = Settings(redis_url=private_redis, data_root=str(tmp_path / "data"), key_prefix="sec",
                        lease_ttl_s=6, heartbeat_s=1)  # fmt: skip
    env = {"REGEN_REDIS_URL": private_redis, "REGEN_DATA_ROOT": settings.data_root, "REGEN_KEY_PREFIX": "sec",
           "REGEN_ENDPOINT_API_KEY": API_KEY, "FLOWER_BASIC_AUTH": "ops:flower-pw", "REGEN_LOG_LEVEL": "DEBUG"}  # fmt: skip
    full_env = {**os.environ, **env}
    logs = tmp_path / "logs"
    logs.mkdir()
    flower_port = free_port()
    metrics_port = free_port()
    flower = spawn(regen_cmd("flower", "--port", str(flower_port)), env=env, log=logs / "flower.log")
    try:
        wait_http(f"http://127.0.0.1:{flower_port}/healthcheck", proc=flower, timeout_s=30)
        assert httpx.get(f"http://127.0.0.1:{flower_port}/api/workers").status_code == 401
        with sim_server("--decode-tok-s", "0", "--api-key", API_KEY, log=logs / "sim.log") as url:
            res = enqueue(settings, write_prompt_mix(tmp_path, "secret-run", 60, 20))
            extra = ("--metrics-port", str(metrics_port))
            with worker_process(env, url, log=logs / "worker.log", extra=extra) as w:
                wait_run_done(settings, res.run_id, procs=(w,))
                metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        status = subprocess.run(regen_cmd("status", res.run_id, "--json"), env=full_env, capture_output=True,
                                text=True, check=True)  # fmt: skip
        status_text = subprocess.run(
            regen_cmd("status"), env=full_env, capture_output=True, text=True, check=True
        )
        resume = subprocess.run(
            regen_cmd("resume", res.run_id), env=full_env, capture_output=True, text=True, check=True
        )
        auth = ("ops", "flower-pw")
        deadline = time.monotonic() + 20
        tasks: dict = {}
        while time.monotonic() < deadline and len(tasks) < 3:
            tasks = httpx.get(f"http://127.0.0.1:{flower_port}/api/tasks", auth=auth).json()
            time.sleep(0.5)
    finally:
        stop(flower)
    # Flower shows the shard tasks by run and shard, with references only as arguments
    names = {t["name"] for t in tasks.values()}
    assert {f"regen.shard[{res.run_id}/{i:05d}]" for i in range(3)} <= names, names
    outputs = [
        status.stdout,
        status.stderr,
        status_text.stdout,
        resume.stdout,
        resume.stderr,
        json.dumps(tasks),
    ]
    outputs += [p.read_text(errors="replace") for p in logs.glob("*.log")]
    for text in outputs:
        assert REDIS_PASSWORD not in text and API_KEY not in text
    assert "***" in (logs / "worker.log").read_text()  # the broker URL is logged, redacted
    # Prometheus: rows, tokens, in-flight per endpoint, errors by class, endpoint health
    assert 'regen_rows_finished_total{outcome="answered"} 60.0' in metrics
    for name in (
        "regen_client_inflight_requests",
        "regen_client_endpoint_health",
        "regen_client_output_tokens_total",
    ):
        assert name in metrics
    assert len(output_rows(settings, res.run_id)) == 60


def test_bad_input_never_stops_a_run(settings, settings_env, tmp_path):
    good = [{"conversations": [{"from": "human", "value": f"good question {i}"}]} for i in range(20)]
    bad_lines = [
        json.dumps({"conversations": "not a list"}),  # wrong type
        json.dumps({"id": 3}),  # missing field
        json.dumps({"conversations": []}),  # empty conversation
        json.dumps({"conversations": [{"from": "narrator", "value": "x"}]}),  # unknown role
        json.dumps({"conversations": [{"from": "human", "value": 42}]}),  # wrong value type
        '{"conversations": [{"from": "human", "value": "broken json"',  # not JSON
    ]
    huge = {"conversations": [{"from": "human", "value": "word " * 210_000}]}  # ~1 MB prompt
    too_long = {"conversations": [{"from": "human", "value": "token " * 5000}]}  # longer than the context
    path = tmp_path / "corpus.jsonl"
    with path.open("wb") as f:
        for row in good:
            f.write(json.dumps(row).encode() + b"\n")
        for line in bad_lines:
            f.write(line.encode() + b"\n")
        f.write(b'{"conversations": [{"from": "human", "value": "bad \xff\xfe bytes"}]}\n')  # invalid UTF-8
        f.write(json.dumps(huge).encode() + b"\n")
        f.write(json.dumps(too_long).encode() + b"\n")
    mix = tmp_path / "corpus.yaml"
    mix.write_text(yaml.safe_dump({
        "name": "corpus", "target": {"model": "moonshotai/Kimi-K2.5", "api": "chat"}, "shard_size": 10,
        "sources": [{"name": "corpus", "path": str(path), "format": "sharegpt"}],
    }))  # fmt: skip
    res = enqueue(settings, mix)
    sim = ("--decode-tok-s", "0", "--context-length", "4096")
    with sim_server(*sim) as url, worker_process(settings_env, url, log=tmp_path / "w.log") as w:
        st = wait_run_done(settings, res.run_id, procs=(w,))
    root = Path(settings.data_root_resolved) / "runs" / res.run_id
    quarantine = pq.read_table(root / "quarantine.parquet").to_pylist()
    assert len(quarantine) == len(bad_lines) + 1  # + the invalid UTF-8 line
    assert all(q["reason"] for q in quarantine)
    rows = output_rows(settings, res.run_id)
    errors = [r for r in rows if r["error"]]
    assert len(rows) == 22 and len(errors) == 2
    assert all(r["error_class"] == "terminal_row" and "context" in r["error"] for r in errors)
    assert st["prompts_failed"] == 2 and st["prompts_done"] == 22
