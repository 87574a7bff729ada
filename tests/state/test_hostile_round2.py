"""Hostile inputs, round two, against the run's state: a data-root writer who rewrites a run's stored
mix to run a tokenizer folder's code, tasks for shards a run does not have (and the ledger such a task
poisoned before), planted output files, a mix nested 100k deep. Real Redis, real Celery workers in their
own processes, the real `regen` CLI, Parquet read back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import yaml

from regen_service.produce.producer import enqueue
from regen_service.state.ledger import Ledger
from regen_service.state.queue import PROCESS_SHARD, make_celery, send_shard
from regen_service.state.status import run_status
from tests.e2e.test_exactly_once import output_rows, write_prompt_mix
from tests.procs import regen_cmd, sim_server, wait_run_done, worker_process

DEMO_TOKENIZER = Path(__file__).resolve().parents[2] / "regen_service" / "demo" / "tokenizer"


def regen(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        regen_cmd(*args), env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


def wait_for(predicate, timeout_s: float = 180.0, what: str = "", procs: tuple = ()):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        for p in procs:
            assert p.poll() is None, f"a process exited with {p.returncode} while waiting for {what}"
        time.sleep(0.3)
    raise TimeoutError(f"not in {timeout_s}s: {what}")


def _evil_tokenizer(tmp_path: Path, marker: Path) -> Path:
    """The demo tokenizer with an auto_map to a module that writes `marker` when it is imported."""
    folder = tmp_path / "evil-tokenizer"
    shutil.copytree(DEMO_TOKENIZER, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizerFast"]}
    cfg["tokenizer_class"] = "EvilTokenizerFast"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "tokenization_evil.py").write_text(
        f"open({str(marker)!r}, 'a').write('ran\\n')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class EvilTokenizerFast(PreTrainedTokenizerFast):\n    pass\n"
    )
    return folder


def test_a_stored_mix_cannot_grant_remote_code(settings, settings_env, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(6)))
    mix = tmp_path / "gen.yaml"
    mix.write_text(yaml.safe_dump({
        "name": "gen", "target": {"model": "moonshotai/Kimi-K2.5", "api": "generate",
                                  "tokenizer": str(DEMO_TOKENIZER)},
        "sampling": {"max_new_tokens": 16}, "shard_size": 3,
        "sources": [{"name": "p", "path": str(data), "format": "prompt_response"}],
    }))  # fmt: skip
    res = enqueue(settings, mix)  # a clean tokenizer: enqueue has nothing to refuse
    # The attacker can write the data root: the stored mix now names their folder and asks for its code.
    marker = tmp_path / "PWNED"
    stored = Path(settings.data_root) / "runs" / res.run_id / "mix.json"
    spec = json.loads(stored.read_text())
    spec["target"].update(tokenizer=str(_evil_tokenizer(tmp_path, marker)), trust_remote_code=True)
    stored.write_text(json.dumps(spec))

    log = tmp_path / "w.log"
    sim = ("--decode-tok-s", "0", "--tokenizer", str(DEMO_TOKENIZER))
    with sim_server(*sim) as url, worker_process(settings_env, url, log=log) as w:
        st = wait_for(
            lambda: (s := run_status(Ledger(settings), res.run_id)) and s["state"] == "failed" and s,
            what="both shards refused", procs=(w,),
        )  # fmt: skip
    assert not marker.exists(), "a worker without --trust-remote-code ran the tokenizer folder's code"
    assert st["shards_failed"] == 2 and output_rows(settings, res.run_id) == []
    for why in st["failed_shards"].values():
        assert "target.trust_remote_code" in why and "--trust-remote-code" in why, why
    assert "resume" in st["next_step"]
    text = regen(settings_env, "status", res.run_id)
    assert "failed: " in text.stdout and "regen worker --trust-remote-code" in text.stdout, text.stdout
    worker_log = log.read_text()
    assert f"shard {res.run_id}/00000 failed: " in worker_log and "--trust-remote-code" in worker_log
    assert "Traceback" not in worker_log

    # The worker's own opt-in is the permission: started with it, `regen resume` finishes the run.
    with (
        sim_server(*sim) as url,
        worker_process(settings_env, url, log=log, extra=("--trust-remote-code",)) as w,
    ):
        assert regen(settings_env, "resume", res.run_id).returncode == 0
        st = wait_run_done(settings, res.run_id, procs=(w,), timeout_s=240)
    assert marker.exists(), "the opted-in worker did not load the folder the run asks for"
    assert st["shards_failed"] == 0 and st["failed_shards"] == {}
    assert len(output_rows(settings, res.run_id)) == 6


def test_a_task_for_a_shard_the_run_lacks_changes_nothing(settings, settings_env, tmp_path):
    res = enqueue(settings, write_prompt_mix(tmp_path, "bogus", 8, 4))
    log = tmp_path / "w.log"
    with sim_server("--decode-tok-s", "0") as url, worker_process(settings_env, url, log=log) as w:
        wait_run_done(settings, res.run_id, procs=(w,), timeout_s=240)
        app = make_celery(settings)
        with app.producer_or_acquire():
            send_shard(app, res.run_id, 99999)  # through the real queue, to a finished run
            send_shard(app, res.run_id, 2)  # one past the last shard
        wait_for(lambda: log.read_text().count("refused a task: shard") >= 2, what="refusals", procs=(w,))
        time.sleep(1.0)  # had a refused task changed the ledger, status would now show it
    text = log.read_text()
    assert f"refused a task: shard 99999 is not a shard of run '{res.run_id}'" in text
    assert "Traceback" not in text
    ledger = Ledger(settings)
    st = run_status(ledger, res.run_id)
    assert st["state"] == "done" and st["shards_total"] == 2 and st["shards_failed"] == 0
    assert set(ledger.shard_states(res.run_id)) == {0, 1}

    # A ledger the old bug poisoned (the task counted, then failed for good): resume repairs it.
    ledger.set_shard_failed(res.run_id, 99999, "FileNotFoundError: prompts/shard-99999.parquet")
    assert run_status(ledger, res.run_id)["state"] == "failed"
    out = regen(settings_env, "resume", "bogus")  # by mix name, as status accepts it
    assert out.returncode == 0, out.stderr
    st = run_status(ledger, res.run_id)
    assert st["state"] == "done" and st["shards_total"] == 2 and st["failed_shards"] == {}
    assert set(ledger.shard_states(res.run_id)) == {0, 1}


def test_every_shard_task_is_named_after_its_shard(settings, settings_env, tmp_path):
    """Flower shows the name the worker's events carry: a message sent without a shadow name (Flower's
    send-task, `celery call`) and a retry (a shard busy elsewhere) are named regen.shard[<run>/<shard>]."""
    res = enqueue(settings, write_prompt_mix(tmp_path, "names", 8, 4))
    # held by someone else until the worker's first try at shard 1 was retried (however slow its start)
    holder = Ledger(settings.model_copy(update={"lease_ttl_s": 600.0}))
    assert holder.acquire_lease(res.run_id, 1, "someone-else")
    app = make_celery(settings)
    with app.producer_or_acquire():
        app.send_task(PROCESS_SHARD, args=[res.run_id, 0])  # no shadow name
    log = tmp_path / "w.log"
    with sim_server("--decode-tok-s", "0") as url, worker_process(settings_env, url, log=log) as w:
        wait_for(lambda: "retry: Retry in" in log.read_text(), what="shard 1 retried", procs=(w,))
        holder.release_lease(res.run_id, 1, "someone-else")
        wait_run_done(settings, res.run_id, procs=(w,), timeout_s=240)
    received = [line for line in log.read_text().splitlines() if "] received" in line]
    assert len(received) >= 4, received  # 2 sent by enqueue, 1 without a name, >= 1 retry of shard 1
    assert all("Task regen.shard[" in line for line in received), received
    assert sum(f"regen.shard[{res.run_id}/00001]" in line for line in received) >= 2


def test_planted_output_files_are_ignored_by_resume(settings, settings_env, tmp_path):
    res = enqueue(settings, write_prompt_mix(tmp_path, "planted", 8, 4))
    outputs = Path(settings.data_root) / "runs" / res.run_id / "outputs"
    outputs.mkdir(parents=True, exist_ok=True)
    (outputs / "shard-x.parquet").write_bytes(b"not parquet")
    (outputs / "shard-99999.parquet").write_bytes(b"not parquet either")
    out = regen(settings_env, "resume", res.run_id, "--json")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"ignoring {outputs}/shard-x.parquet: not a shard file name" in out.stderr
    assert f"ignoring {outputs}/shard-99999.parquet: run {res.run_id} has no shard 99999" in out.stderr
    assert json.loads(out.stdout)["shards_total"] == 2
    st = run_status(Ledger(settings), res.run_id)
    assert st["shards_total"] == 2 and st["shards_done"] == 0


def test_a_mix_nested_100k_deep_is_one_line(settings_env, tmp_path):
    mix = tmp_path / "deep.yaml"
    mix.write_text("name: deep\ntarget: " + "[" * 100_000 + "]" * 100_000 + "\n")
    out = regen(settings_env, "enqueue", str(mix))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip() == f"Error: {mix}: line 2: nested more than 64 levels deep; a mix file never " \
        "needs that: write its fields out plainly"  # fmt: skip
    assert not (Path(settings_env["REGEN_DATA_ROOT"]) / "runs").exists()
