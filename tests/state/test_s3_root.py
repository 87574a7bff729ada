"""The data root on a real S3 API (moto's server, authentication on; tests/s3.py): the whole flow on
s3://, what a shard costs in requests, no half-visible shard after a kill, and bad input refused in
one line before anything is written. Real processes, real Redis, Parquet read back from the store."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import threading
import time
from collections import Counter

import pyarrow.parquet as pq
import pytest
import yaml

from regen_service.state.ledger import Ledger
from tests.e2e.test_exactly_once import sim_stats, wipe, write_prompt_mix
from tests.procs import regen_cmd, sim_server, spawn, stop, wait_progress, wait_run_done
from tests.s3 import BUCKET, moto_s3


def _run(cmd, env, **kw):
    return subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=300, **kw)


def _objects(fs, prefix: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(fs.find(prefix))


def test_bad_s3_input_is_one_line_before_any_work(settings_env, tmp_path):
    mix = write_prompt_mix(tmp_path, "s3-bad", 4, 2)
    # an HTTP server that is no S3 API
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    with moto_s3(tmp_path, auth=True) as locked, moto_s3(tmp_path) as s3:
        good = {**settings_env, **s3.env, "REGEN_DATA_ROOT": f"s3://{BUCKET}/root"}
        cases = {
            # a store that refuses the request's credentials (tests/s3.py: moto with auth on)
            "access refused": {**good, **locked.env, "AWS_SECRET_ACCESS_KEY": "wrong"},
            "does not exist": {**good, "REGEN_DATA_ROOT": "s3://no-such-bucket/root"},
            "is the endpoint an S3 API": {
                **good,
                "AWS_ENDPOINT_URL": f"http://127.0.0.1:{httpd.server_port}",
            },
        }
        for words, env in cases.items():
            for cmd in (
                regen_cmd("enqueue", str(mix)),
                regen_cmd("worker", "--endpoint", "http://127.0.0.1:9"),
            ):
                out = _run(cmd, env)
                lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
                assert out.returncode != 0 and len(lines) == 1 and words in lines[0], (cmd, out.stderr)
                assert "wrong" not in lines[0] and s3.env["AWS_SECRET_ACCESS_KEY"] not in lines[0]
        # nothing written, in either store; and nothing in Redis (enqueue checks before it writes)
        assert _objects(s3.fs(), BUCKET) == []
        assert not [o for o in locked.requests() if o[0] in ("PUT", "POST", "DELETE")][4:]
    httpd.shutdown()


@pytest.mark.timeout(600)
def test_whole_flow_on_s3(settings, settings_env, tmp_path):
    from regen_service.train.fixtures import make_tiny_target

    with moto_s3(tmp_path) as s3:
        root = f"s3://{BUCKET}/root"
        env = {**settings_env, **s3.env, "REGEN_DATA_ROOT": root}
        s3_settings = settings.model_copy(update={"data_root": root})
        fs = s3.fs()
        t0 = time.monotonic()
        out = _run(regen_cmd("enqueue", str(write_prompt_mix(tmp_path, "s3-flow", 40, 8)), "--json"), env)
        assert out.returncode == 0, out.stderr
        res = json.loads(out.stdout)
        run_id, num_shards = res["run_id"], res["num_shards"]
        outputs = f"{BUCKET}/root/runs/{run_id}/outputs"
        since = s3.offset()
        sim = ("--decode-tok-s", "30", "--answer-len-mean", "20", "--max-running-requests", "8")
        wargs = ("--max-inflight-per-endpoint", "4")
        with sim_server(*sim) as url:
            a = spawn(regen_cmd("worker", "--endpoint", url, *wargs), env=env, log=tmp_path / "a.log")
            ledger = Ledger(s3_settings)
            try:
                wait_progress(lambda: (ledger.run_counters(run_id).shard_states.get(0) == "done"
                                       and ledger.run_counters(run_id).prompts_done < 40,
                                       ledger.run_counters(run_id).prompts_done),
                              what="a first shard on S3", stall_s=90, procs=(a,))  # fmt: skip
                os.killpg(a.pid, signal.SIGKILL)  # mid-run, mid-shard
                a.wait()
            finally:
                stop(a)
            # No half-visible shard: every final shard object is a whole Parquet file of its 8 rows, and no
            # temporary object is left (a PUT shows an object whole or not at all).
            objs = _objects(fs, outputs)
            finals = [o for o in objs if o.rsplit("/", 1)[1].startswith("shard-")]
            assert finals and not [o for o in objs if "/.tmp-" in o]
            for o in finals:
                with fs.open(o, "rb") as f:
                    assert pq.read_table(f).num_rows == 8
            # Redis lost as well: resume rebuilds it from S3 alone.
            assert wipe(settings) > 0
            out = _run(regen_cmd("resume", run_id, "--json"), env)
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["shards_done"] == len(finals)
            b = spawn(regen_cmd("worker", "--endpoint", url, *wargs), env=env, log=tmp_path / "b.log")
            try:
                st = wait_run_done(s3_settings, run_id, procs=(b,), timeout_s=90)
            finally:
                stop(b)
            stats = sim_stats(url)
        wall_s = time.monotonic() - t0
        reqs = s3.requests(since)
        rows = []
        for o in _objects(fs, outputs):
            if o.rsplit("/", 1)[1].startswith("shard-"):
                with fs.open(o, "rb") as f:
                    rows += pq.read_table(f).to_pylist()
        assert len(rows) == len({r["prompt_id"] for r in rows}) == 40 == st["prompts_done"]
        assert not [o for o in _objects(fs, outputs) if "/parts/" in o]  # shard logs removed once final
        # asked twice: only what was in flight at the kill (4) and the rows answered in the last flush
        # interval (1 s, ~6 rows at this speed) not yet in a part object: an object store has no append
        assert 40 <= stats["requests_total"] <= 40 + 4 + 8
        by_method = Counter(m for m, _, _ in reqs)
        print(f"S3 run: 40 prompts, {num_shards} shards, {len(reqs)} S3 requests from the first worker to "
              f"done ({len(reqs) / num_shards:.1f} per shard: {dict(by_method)}), a kill, a Redis wipe and a "
              f"resume included; wall {wall_s:.1f}s")  # fmt: skip
        assert len(reqs) / num_shards < 60

        # Reuse on S3: the same prompts under another mix name are answered from the first run.
        mix2 = write_prompt_mix(tmp_path, "s3-reuse", 40, 8)
        out = _run(regen_cmd("enqueue", str(mix2), "--json"), env)
        assert out.returncode == 0, out.stderr
        run2 = json.loads(out.stdout)["run_id"]
        with fs.open(f"{BUCKET}/root/runs/{run2}/manifest.json") as f:
            assert json.load(f)["num_reused"] == 40

        # The trainer reads its shards from S3.
        target = make_tiny_target(tmp_path / "target", layers=4, hidden=32, heads=4, kv_heads=2)
        cfg = tmp_path / "train.yaml"
        cfg.write_text(yaml.safe_dump({"draft_vocab_size": 256, "max_length": 128, "batch_size": 4, "epochs": 1,
                                       "ttt_length": 2, "eval_fraction": 0.0, "poll_s": 0.3}))  # fmt: skip
        train = regen_cmd("train", "--run", run_id, "--target", str(target), "--out", str(tmp_path / "out"),
                          "--config", str(cfg), "--device", "cpu")  # fmt: skip
        done = _run(train, env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout.strip().splitlines()[-1])["consumed"] == num_shards
