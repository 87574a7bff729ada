"""Workers that keep servers full and recover: endpoints down or serving another model at start, a worker
that gives up (for its supervisor) when told to, resumed shards ahead of a new run, and small shards that
still fill every slot. Real Redis, real `regen worker` processes, the simulator over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import httpx

from regen_service.produce.producer import enqueue
from regen_service.state.resume import resume_run
from tests.e2e.test_exactly_once import sim_stats, write_prompt_mix
from tests.procs import free_port, regen_cmd, sim_server, spawn, stop, wait_run_done, worker_process


def _status_json(settings_env: dict, run_id: str) -> dict:
    out = subprocess.run(regen_cmd("status", run_id, "--json"), env={**os.environ, **settings_env},
                         capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout)


def _wait_for(predicate, timeout_s: float, what: str, procs=()):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for p in procs:
            assert p.poll() is None, f"a process exited ({p.returncode}) while waiting for {what}"
        time.sleep(0.3)
    raise TimeoutError(f"not seen in {timeout_s}s: {what}")


def test_worker_uses_an_endpoint_that_comes_up_late(settings, settings_env, tmp_path):
    """Endpoint down at start, then serving another model, then the right one: the worker says so in
    status meanwhile and finishes the run once the endpoint is healthy."""
    res = enqueue(settings, write_prompt_mix(tmp_path, "late-endpoint", 30, 10))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with worker_process(settings_env, url, log=tmp_path / "w.log") as w:
        st = _wait_for(lambda: (s := _status_json(settings_env, res.run_id))["workers"]
                       and s["live_consumers"] == 0 and s, 60, "the worker reporting no endpoint", (w,))  # fmt: skip
        assert st["workers"][0]["state"] == "no_endpoint"
        status_text = subprocess.run(regen_cmd("status", res.run_id), env={**os.environ, **settings_env},
                                     capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert "no live consumer for this run" in status_text
        with sim_server("--decode-tok-s", "0", "--model", "someone/else", port=port):
            _wait_for(lambda: "someone/else" in (_status_json(settings_env, res.run_id)["workers"][0]["reason"]),
                      60, "the worker naming the wrong model", (w,))  # fmt: skip
        with sim_server("--decode-tok-s", "0", port=port) as url2:
            wait_run_done(settings, res.run_id, procs=(w,), timeout_s=90)
            assert sim_stats(url2)["completed"] >= 30
        assert _status_json(settings_env, res.run_id)["live_consumers"] == 1


def test_worker_exits_non_zero_without_an_endpoint_when_told(settings, settings_env, tmp_path):
    enqueue(settings, write_prompt_mix(tmp_path, "no-endpoint", 10, 10))
    url = f"http://127.0.0.1:{free_port()}"
    proc = spawn(regen_cmd("worker", "--endpoint", url, "--exit-after-no-endpoint-s", "3"), env=settings_env,
                 log=tmp_path / "w.log")  # fmt: skip
    try:
        assert proc.wait(timeout=90) == 3
    finally:
        stop(proc)
    assert "no usable endpoint for 3s" in Path(tmp_path / "w.log").read_text()


def test_resumed_shard_goes_before_a_new_run(settings, settings_env, tmp_path):
    first = enqueue(settings, write_prompt_mix(tmp_path, "in-progress", 8, 4))
    with sim_server("--decode-tok-s", "0") as url:
        with worker_process(settings_env, url, log=tmp_path / "w1.log") as w:
            wait_run_done(settings, first.run_id, procs=(w,))
        lost = Path(settings.data_root_resolved) / "runs" / first.run_id / "outputs" / "shard-00001.parquet"
        lost.unlink()  # the shard must be done again
        second = enqueue(settings, write_prompt_mix(tmp_path, "new-run", 24, 4))
        assert resume_run(settings, first.run_id).shards_sent == [1]
        # One shard at a time, so the order shards finish in is the order they were taken in.
        with worker_process(
            settings_env, url, log=tmp_path / "w2.log", extra=("--max-shards-in-hand", "1")
        ) as w:
            wait_run_done(settings, second.run_id, procs=(w,))
            wait_run_done(settings, first.run_id, procs=(w,))
    outputs = Path(settings.data_root_resolved) / "runs" / second.run_id / "outputs"
    assert lost.stat().st_mtime < min(p.stat().st_mtime for p in outputs.glob("shard-*.parquet"))


def test_small_shards_fill_every_slot(settings, settings_env, tmp_path):
    """Shards of 16 prompts against a server with 96 slots: the worker holds as many shards as it takes
    (two would leave two thirds of the slots empty)."""
    res = enqueue(settings, write_prompt_mix(tmp_path, "small-shards", 400, 16))
    with sim_server("--decode-tok-s", "40", "--max-running-requests", "96", "--answer-len-mean", "40") as url:
        with worker_process(settings_env, url, log=tmp_path / "w.log") as w:
            wait_run_done(settings, res.run_id, procs=(w,), timeout_s=120)
        stats = httpx.get(f"{url}/sim/stats", timeout=5).json()
    assert stats["peak_running"] == 96
    log = (tmp_path / "w.log").read_text()
    assert "shard intake by in-flight budget" in log
    # One runtime per process: one pool (a second would double the load on the server).
    assert log.count("endpoint pool for moonshotai/Kimi-K2.5 ready") == 1
