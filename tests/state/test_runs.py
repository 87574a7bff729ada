"""Several runs at once, reuse of earlier answers, and retry-failed, with real workers and the simulator."""

from __future__ import annotations

import json
import os
import subprocess

import httpx

from regen_service.produce.producer import enqueue
from regen_service.state.ledger import Ledger
from tests.e2e.test_exactly_once import output_rows, write_prompt_mix
from tests.procs import regen_cmd, sim_server, wait_run_done, worker_process


def test_two_runs_at_once_and_status_shows_both(settings, settings_env, tmp_path):
    a = enqueue(settings, write_prompt_mix(tmp_path, "run-a", 120, 30))
    sim = ("--decode-tok-s", "200", "--answer-len-mean", "20")
    with sim_server(*sim) as url, worker_process(settings_env, url, log=tmp_path / "w.log") as w:
        b = enqueue(settings, write_prompt_mix(tmp_path, "run-b", 90, 30))
        out = subprocess.run(regen_cmd("status", "--json"), env={**os.environ, **settings_env},
                             capture_output=True, text=True, check=True)  # fmt: skip
        listed = {r["run_id"] for r in json.loads(out.stdout)["runs"]}
        assert {a.run_id, b.run_id} <= listed
        wait_run_done(settings, a.run_id, procs=(w,))
        wait_run_done(settings, b.run_id, procs=(w,))
    assert len(output_rows(settings, a.run_id)) == 120
    assert len(output_rows(settings, b.run_id)) == 90


def test_reuse_answers_from_an_earlier_run(settings, settings_env, tmp_path):
    first = write_prompt_mix(tmp_path, "base", 60, 30)
    # the second mix: the same 60 prompts plus 40 new ones, same model and sampling
    bigger = tmp_path / "more.jsonl"
    lines = (tmp_path / "base.jsonl").read_text().splitlines()
    extra = [json.dumps({"prompt": f"a new question {i}"}) for i in range(40)]
    bigger.write_text("\n".join(lines + extra) + "\n")
    second = tmp_path / "second.yaml"
    second.write_text(
        first.read_text()
        .replace("name: base", "name: second")
        .replace(str(tmp_path / "base.jsonl"), str(bigger))
    )
    with (
        sim_server("--decode-tok-s", "0") as url,
        worker_process(settings_env, url, log=tmp_path / "w.log") as w,
    ):
        r1 = enqueue(settings, first)
        wait_run_done(settings, r1.run_id, procs=(w,))
        asked_before = httpx.get(f"{url}/sim/stats").json()["requests_total"]
        r2 = enqueue(settings, second)
        wait_run_done(settings, r2.run_id, procs=(w,))
        asked = httpx.get(f"{url}/sim/stats").json()["requests_total"] - asked_before
        r3 = enqueue(settings, second, reuse=False)
        assert r3.run_id == r2.run_id and not r3.created  # same content: the same run, nothing new
    rows = output_rows(settings, r2.run_id)
    assert len(rows) == 100
    reused = [r for r in rows if r["reused_from"]]
    assert len(reused) == 60 and {r["reused_from"] for r in reused} == {r1.run_id}
    assert asked == 40
    base = {r["prompt_id"]: r["messages"] for r in output_rows(settings, r1.run_id)}
    assert all(base[r["prompt_id"]] == r["messages"] and r["run_id"] == r2.run_id for r in reused)


def test_no_reuse_asks_everything(settings, settings_env, tmp_path):
    first = write_prompt_mix(tmp_path, "nr-base", 30, 30)
    second = tmp_path / "nr2.yaml"
    second.write_text(first.read_text().replace("name: nr-base", "name: nr-second"))
    with (
        sim_server("--decode-tok-s", "0") as url,
        worker_process(settings_env, url, log=tmp_path / "w.log") as w,
    ):
        r1 = enqueue(settings, first)
        wait_run_done(settings, r1.run_id, procs=(w,))
        out = subprocess.run(regen_cmd("enqueue", str(second), "--no-reuse", "--json"),
                             env={**os.environ, **settings_env}, capture_output=True, text=True, check=True)  # fmt: skip
        r2 = json.loads(out.stdout)["run_id"]
        wait_run_done(settings, r2, procs=(w,))
        assert httpx.get(f"{url}/sim/stats").json()["requests_total"] == 60
    assert not any(r["reused_from"] for r in output_rows(settings, r2))


def test_retry_failed_sends_exhausted_rows_again(settings, settings_env, tmp_path):
    res = enqueue(settings, write_prompt_mix(tmp_path, "flaky", 40, 20))
    env = {**os.environ, **settings_env}
    with sim_server("--decode-tok-s", "0", "--fault-503-rate", "1.0") as url:
        with worker_process(settings_env, url, log=tmp_path / "w1.log", extra=("--max-attempts", "2")) as w:
            st = wait_run_done(settings, res.run_id, procs=(w,))
        assert st["prompts_failed"] == 40
        rows = output_rows(settings, res.run_id)
        assert {r["error_class"] for r in rows} == {"retries_exhausted"} and all(r["error"] for r in rows)
        httpx.post(f"{url}/sim/config", json={"fault_503_rate": 0.0}).raise_for_status()
        out = subprocess.run(
            regen_cmd("retry-failed", res.run_id), env=env, capture_output=True, text=True, check=True
        )
        assert json.loads(out.stdout)["rows_to_retry"] == 40
        with worker_process(settings_env, url, log=tmp_path / "w2.log") as w:
            st = wait_run_done(settings, res.run_id, procs=(w,))
    rows = output_rows(settings, res.run_id)
    assert len(rows) == 40 and all(r["error"] is None for r in rows)
    assert st["prompts_failed"] == 0
    events = Ledger(settings).r.xrange(Ledger(settings).events_key(res.run_id))
    assert (
        len([e for _, e in events if e["type"] == "shard_done"]) == 4
    )  # each shard announced again once redone


def test_storage_wins_over_a_stale_ledger(settings, settings_env, tmp_path):
    """Outputs deleted behind the ledger's back: enqueueing again queues those shards; another data root is refused."""
    import shutil

    import pytest

    from regen_service.errors import ConfigError

    mix = write_prompt_mix(tmp_path, "stale", 40, 20)
    with (
        sim_server("--decode-tok-s", "0") as url,
        worker_process(settings_env, url, log=tmp_path / "w.log") as w,
    ):
        res = enqueue(settings, mix)
        wait_run_done(settings, res.run_id, procs=(w,))
        shutil.rmtree(f"{settings.data_root_resolved}/runs/{res.run_id}/outputs")
        again = enqueue(settings, mix)
        assert not again.created and again.num_tasks_sent == 2 and "queued again" in again.message
        wait_run_done(settings, res.run_id, procs=(w,))
    assert len(output_rows(settings, res.run_id)) == 40
    other = settings.model_copy(update={"data_root": str(tmp_path / "elsewhere")})
    with pytest.raises(ConfigError, match="REGEN_KEY_PREFIX"):
        enqueue(other, mix)
