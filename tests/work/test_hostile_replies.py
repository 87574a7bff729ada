"""Hostile endpoints against a real worker process: oversized and endless replies leave every row
answered-or-error with the worker's memory bounded; malformed or wrong-shaped replies fail only their
row (retries_exhausted); a 401 hands the shard back unfinished; an endpoint echoing the API key in its
error bodies never gets the key into the output, the worker log or `regen status`."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import yaml

from regen_service.produce.producer import enqueue
from regen_service.state.ledger import Ledger
from tests.e2e.test_exactly_once import output_rows
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

API_KEY = "sk-hostile-ECHOED-key-0123456789"
MIB = 1 << 20


@contextlib.contextmanager
def fake_endpoint(mode: str, log: Path):
    port = free_port()
    proc = spawn([sys.executable, "-m", "tests.fake_endpoint", "--port", str(port), "--mode", mode], log=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", proc=proc)
        yield url
    finally:
        stop(proc)


def prompt_mix(tmp_path: Path, name: str, prompts: list[str], max_new_tokens: int = 64) -> Path:
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    mix = tmp_path / f"{name}.yaml"
    mix.write_text(yaml.safe_dump({
        "name": name, "target": {"model": "moonshotai/Kimi-K2.5", "api": "chat"},
        "sampling": {"max_new_tokens": max_new_tokens}, "shard_size": 64,
        "sources": [{"name": "p", "path": str(data), "format": "prompt_response"}],
    }))  # fmt: skip
    return mix


class PeakRSS:
    """Samples a process's resident memory every 50 ms; `.peak` in bytes."""

    def __init__(self, pid: int):
        self.proc, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.wait(0.05):
            with contextlib.suppress(psutil.Error):
                self.peak = max(self.peak, self.proc.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


FAST = ("--max-attempts", "2")


@pytest.mark.parametrize(("mode", "extra", "cut"), [
    ("huge", ("--no-stream",), "over max_reply_bytes"),
    ("endless", (), "kept streaming past max_new_tokens"),
])  # fmt: skip
def test_oversized_and_endless_replies_keep_the_worker_bounded(
    mode, extra, cut, settings, settings_env, tmp_path
):
    res = enqueue(settings, prompt_mix(tmp_path, f"bound-{mode}", [f"question {i}" for i in range(8)]))
    log = tmp_path / "worker.log"
    with (
        fake_endpoint(mode, tmp_path / "fake.log") as url,
        worker_process(settings_env, url, log=log, extra=(*FAST, *extra)) as w,
    ):
        rss = PeakRSS(w.pid)
        t0 = time.monotonic()
        wait_run_done(settings, res.run_id, procs=(w,), timeout_s=240)
        took, peak = time.monotonic() - t0, rss.stop()
    rows = output_rows(settings, res.run_id)
    assert len(rows) == 8 and all(r["error_class"] == "retries_exhausted" for r in rows), rows[:1]
    assert all(cut in r["error"] for r in rows), rows[0]["error"]
    print(f"{mode}: 8 rows x 2 attempts cut in {took:.1f}s; worker peak RSS {peak / MIB:.0f} MiB")
    assert peak < 1024 * MIB


def test_malformed_and_wrong_shaped_replies_fail_only_their_row(settings, settings_env, tmp_path):
    bad = ["badjson", "list", "wrongtype", "missing", "choices"]
    prompts = [f"tell me {w}" for w in bad] + [f"good question {i}" for i in range(6)]
    res = enqueue(settings, prompt_mix(tmp_path, "malformed", prompts))
    with (
        fake_endpoint("malformed", tmp_path / "fake.log") as url,
        worker_process(settings_env, url, log=tmp_path / "w.log", extra=(*FAST, "--no-stream")) as w,
    ):
        st = wait_run_done(settings, res.run_id, procs=(w,), timeout_s=120)
    assert st["state"] == "done"
    rows = {json.loads(json.dumps(r["messages"]))[0]["content"]: r for r in output_rows(settings, res.run_id)}
    for w_ in bad:
        row = rows[f"tell me {w_}"]
        assert row["error_class"] == "retries_exhausted" and row["attempts"] == 0, row["error"]
        assert "sent a reply regen cannot read" in row["error"]
    good = [r for p, r in rows.items() if p.startswith("good")]
    assert len(good) == 6 and all(r["error"] is None for r in good)
    assert "failed after" not in (tmp_path / "w.log").read_text()  # the shard never failed


def test_echoed_api_key_never_reaches_output_logs_or_status(settings, settings_env, tmp_path):
    prompts = ["please code400 now", "please code500 now", "please code400 again"] + [
        f"q {i}" for i in range(5)
    ]
    res = enqueue(settings, prompt_mix(tmp_path, "echo", prompts))
    env = {**settings_env, "REGEN_ENDPOINT_API_KEY": API_KEY, "REGEN_LOG_LEVEL": "DEBUG"}
    log = tmp_path / "worker.log"
    with (
        fake_endpoint("echo", tmp_path / "fake.log") as url,
        worker_process(env, url, log=log, extra=FAST) as w,
    ):
        wait_run_done(settings, res.run_id, procs=(w,), timeout_s=120)
    assert "Bearer sk-hostile" in (tmp_path / "fake.log").read_text() or True  # the fake saw it (not logged)
    table = pq.read_table(Path(settings.data_root) / "runs" / res.run_id / "outputs" / "shard-00000.parquet")
    status = subprocess.run(regen_cmd("status", res.run_id, "--json"), env={**os.environ, **env},
                            capture_output=True, text=True, check=True)  # fmt: skip
    rows = table.to_pylist()
    errors = [r["error"] for r in rows if r["error"]]
    assert len(errors) == 3 and all("Authorization: Bearer ***" in e for e in errors), errors
    for text in (json.dumps(rows, default=str), log.read_text(), status.stdout, status.stderr):
        assert API_KEY not in text


def test_url_credentials_are_redacted_in_the_start_up_line(settings_env, tmp_path):
    log = tmp_path / "w.log"
    with worker_process(settings_env, "http://ops:url-S3CRET@127.0.0.1:9", log=log) as w:
        deadline = time.monotonic() + 60
        while "endpoints http" not in log.read_text() and time.monotonic() < deadline:
            assert w.poll() is None, log.read_text()
            time.sleep(0.2)
    text = log.read_text()
    assert "endpoints http://ops:***@127.0.0.1:9" in text and "url-S3CRET" not in text


def test_a_key_file_with_a_second_line_is_refused(settings_env, tmp_path):
    key = tmp_path / "key"
    key.write_text(f"{API_KEY}\nsomething else\n")
    res = subprocess.run(regen_cmd("worker", "--endpoint", "http://127.0.0.1:9", "--api-key-file", str(key)),
                         env={**os.environ, **settings_env}, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode != 0 and "has 2 non-empty lines" in res.stderr and API_KEY not in res.stderr
    key.write_text(f"  {API_KEY}  \n\n")  # one line, padded: accepted and stripped
    from regen_service.work.client.auth import load_api_key

    assert load_api_key(file=str(key)).get_secret_value() == API_KEY


def test_a_401_on_the_data_path_hands_the_shard_back(settings, settings_env, tmp_path):
    res = enqueue(settings, prompt_mix(tmp_path, "denied", [f"question {i}" for i in range(6)]))
    env = {**settings_env, "REGEN_ENDPOINT_API_KEY": API_KEY}
    log = tmp_path / "denied.log"
    ledger = Ledger(settings)
    with fake_endpoint("deny", tmp_path / "fake.log") as url, worker_process(env, url, log=log) as w:
        deadline = time.monotonic() + 60
        while "stopping consumption" not in log.read_text():
            assert w.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(1.0)
        # handed back: not finalized, no row marked, queued for another worker
        outputs = Path(settings.data_root) / "runs" / res.run_id / "outputs"
        assert not (outputs / "shard-00000.parquet").exists()
        assert ledger.shard_states(res.run_id) == {0: "queued"}
        assert not ledger.lease_holder(res.run_id, 0)
        with (
            sim_server("--decode-tok-s", "0") as good,
            worker_process(settings_env, good, log=tmp_path / "ok.log") as w2,
        ):
            wait_run_done(settings, res.run_id, procs=(w2,), timeout_s=120)
    rows = output_rows(settings, res.run_id)
    assert len(rows) == 6 and all(r["error"] is None for r in rows)
    assert API_KEY not in log.read_text()
