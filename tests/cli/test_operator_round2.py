"""The operator's sharp edges, round two, tried as a new user would with the real `regen` CLI: a done run
whose prompts failed says so and names the next command, `retry-failed` takes a mix name like `status`,
the worker's shard line carries its errors, a failed enqueue leaves no half run, and `--redo` makes a new
run of a mix enqueued before. Real Redis, a real simulator and Celery worker, Parquet read back."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import redis
import yaml

from regen_service.produce.producer import enqueue
from regen_service.state.queue import waiting_shard_ids
from tests.e2e.test_exactly_once import output_rows, write_prompt_mix
from tests.procs import regen_cmd, sim_server, wait_run_done, worker_process


def regen(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        regen_cmd(*args), env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


def test_a_done_run_with_failures_says_so(settings, settings_env, tmp_path):
    res = enqueue(settings, write_prompt_mix(tmp_path, "flaky", 24, 8))
    log = tmp_path / "w.log"
    sim = ("--decode-tok-s", "0", "--fault-503-rate", "0.5")
    with (
        sim_server(*sim) as url,
        worker_process(settings_env, url, log=log, extra=("--max-attempts", "1")) as w,
    ):
        wait_run_done(settings, res.run_id, procs=(w,), timeout_s=240)
    failed = [r for r in output_rows(settings, res.run_id) if r["error"]]
    assert 0 < len(failed) < 24, "the fault rate should fail some prompts, not all"

    st = json.loads(regen(settings_env, "status", "flaky", "--json").stdout)
    assert st["state"] == "done" and st["done_with_failures"] is True
    assert st["prompts_failed"] == len(failed) and st["next_step"].startswith(
        f"regen retry-failed {res.run_id}"
    )
    text = regen(settings_env, "status", "flaky").stdout
    assert f"done ({len(failed)} of 24 prompts failed)" in text and "next: regen retry-failed" in text, text

    # the worker's line for each shard says how many rows failed and why
    lines = [
        line for line in log.read_text().splitlines() if f"shard {res.run_id}/" in line and " done: " in line
    ]
    assert len(lines) == 3, lines
    assert sum(int(line.split(" failed")[0].rsplit(" ", 1)[1]) for line in lines) == len(failed)
    assert any("x retries_exhausted: " in line for line in lines), lines

    # retry-failed by the mix's name, as status takes it (it was a FileNotFoundError traceback)
    out = regen(settings_env, "retry-failed", "flaky")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert json.loads(out.stdout)["rows_to_retry"] == len(failed)
    miss = regen(settings_env, "retry-failed", "no-such-mix")
    assert miss.returncode == 1 and "Traceback" not in miss.stderr
    assert miss.stderr.startswith("Error: no run 'no-such-mix'"), miss.stderr


def test_a_failed_enqueue_leaves_no_half_run(settings, settings_env, tmp_path):
    fake = tmp_path / "rows.parquet"
    fake.write_text('{"prompt": "I am JSON lines, not Parquet"}\n')
    mix = tmp_path / "broken.yaml"
    mix.write_text(yaml.safe_dump({
        "name": "broken", "target": {"model": "moonshotai/Kimi-K2.5", "api": "chat"},
        "sources": [{"name": "rows", "path": str(fake), "format": "prompt_response"}],
    }))  # fmt: skip
    out = regen(settings_env, "enqueue", str(mix))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    runs = Path(settings.data_root) / "runs"
    assert not runs.exists() or not any(runs.iterdir()), list(runs.iterdir())
    # a half run a crash left behind (mix.json, no manifest): runs, status and resume agree it is none
    half = runs / "broken-0123456789ab"
    half.mkdir(parents=True)
    (half / "mix.json").write_text("{}")
    listed = regen(settings_env, "runs")
    assert listed.returncode == 0 and "no runs under the data root" in listed.stdout, listed.stdout
    assert json.loads(regen(settings_env, "status", "--json").stdout) == {"runs": [], "not_in_ledger": []}
    resume = regen(settings_env, "resume", "broken-0123456789ab")
    assert resume.returncode == 1 and "no run 'broken-0123456789ab'" in resume.stderr, resume.stderr


def test_enqueue_redo_makes_a_new_run(settings, settings_env, tmp_path):
    mix = write_prompt_mix(tmp_path, "again", 12, 4)
    first = json.loads(regen(settings_env, "enqueue", str(mix), "--json").stdout)
    again = regen(settings_env, "enqueue", str(mix), "--no-reuse", "--json")
    assert json.loads(again.stdout)["num_tasks_sent"] == 0
    assert (
        "--no-reuse only applies to a new run: `regen enqueue --redo MIX`"
        in json.loads(again.stdout)["message"]
    )

    redo = json.loads(regen(settings_env, "enqueue", str(mix), "--redo", "--json").stdout)
    assert redo["run_id"] == f"{first['run_id']}-r2" and redo["created"] is True
    assert redo["num_tasks_sent"] == 3 and redo["num_prompts"] == 12
    r = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    assert waiting_shard_ids(settings, r, redo["run_id"]) == {0, 1, 2}
    st = json.loads(regen(settings_env, "status", redo["run_id"], "--json").stdout)
    assert st["prompts_total"] == 12 and st["state"] == "queued"
    third = json.loads(regen(settings_env, "enqueue", str(mix), "--redo", "--json").stdout)
    assert third["run_id"] == f"{first['run_id']}-r3"


def test_server_text_in_a_shard_line_is_scrubbed_before_it_is_cut_and_escaped():
    from regen_service.work.client.auth import register_secret
    from regen_service.work.shard_runner import one_line

    key = "sk-live-" + "k" * 40
    register_secret(key)
    forged = "x" * 150 + key + "\n2026-01-01 INFO regen.worker: shard r/00000 done: 8 rows\x1b[2J"
    line = one_line(forged, 160)
    assert "\n" not in line and "\x1b" not in line and "sk-live" not in line and "kkkk" not in line
    assert line.startswith("x" * 150 + "***")
    assert "\\n2026" in one_line(forged, 1000) and "\\x1b[2J" in one_line(forged, 1000)
