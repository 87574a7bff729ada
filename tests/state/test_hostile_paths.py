"""Ids and paths from outside never leave the data root: `regen resume ../../x` and a task sent with such
an id (as anyone reaching the broker or Flower could) are refused and nothing is written outside; the
trainer opens shards from (run, shard) under its own data root, never the path an event names, and a
shard it cannot read is recorded as bad and acked, restarts included."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pydantic
import pytest

from regen_service.draft.checkpoint import load_latest
from regen_service.errors import ConfigError
from regen_service.produce.producer import enqueue
from regen_service.state.ledger import read_shard_done
from regen_service.state.queue import make_celery, send_shard
from regen_service.state.storage import BadRunIdError, RunLayout, Storage, check_run_id
from regen_service.train.consumer import default_consumer_name
from regen_service.train.fixtures import (
    greedy_rows,
    make_tiny_target,
    output_table,
    publish_shard,
    register_run,
)
from schemas.records import ShardDoneEvent
from tests.e2e.test_exactly_once import output_rows, write_prompt_mix
from tests.procs import regen_cmd, sim_server, wait_run_done, worker_process

EVIL = "../../outside/evilrun"


@pytest.mark.parametrize("bad", [EVIL, "..", "/etc", "a/b", "Run.1", "", "x" * 129, "run\x00"])
def test_one_validator_for_run_ids_and_storage_paths(tmp_path, bad):
    with pytest.raises(BadRunIdError, match="invalid run id"):
        check_run_id(bad)
    with pytest.raises(ConfigError):
        RunLayout(Storage(str(tmp_path)), bad)
    with pytest.raises(ConfigError, match="leave the data root"):
        Storage(str(tmp_path)).path("runs", "..")
    assert check_run_id("my-mix_2-0123456789ab") == "my-mix_2-0123456789ab"


@pytest.mark.parametrize("command", [("resume", EVIL), ("retry-failed", EVIL), ("status", EVIL),
                                     ("train", "--run", EVIL, "--target", "x", "--out", "out")])  # fmt: skip
def test_cli_refuses_an_escaping_run_id(command, settings, settings_env, tmp_path):
    res = subprocess.run(regen_cmd(*command), env={**os.environ, **settings_env}, capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    assert res.returncode == 2 and "invalid run id" in res.stderr, res.stderr[-1500:]
    assert not (tmp_path / "outside").exists() and not (tmp_path / "out").exists()


def test_a_task_naming_a_path_outside_the_data_root_is_refused(settings, settings_env, tmp_path):
    res = enqueue(settings, write_prompt_mix(tmp_path, "legit", 8, 4))
    # the attacker's copy of a real run, where `runs/../../outside/evilrun` points from the data root
    outside = Path(settings.data_root).parent / "outside" / "evilrun"
    shutil.copytree(Path(settings.data_root) / "runs" / res.run_id, outside)
    app = make_celery(settings)
    with app.producer_or_acquire():
        send_shard(app, EVIL, 0)
    log = tmp_path / "w.log"
    with sim_server("--decode-tok-s", "0") as url, worker_process(settings_env, url, log=log) as w:
        wait_run_done(settings, res.run_id, procs=(w,))
        deadline = time.monotonic() + 30
        while "refused a task" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
    assert "refused a task: invalid run id '../../outside/evilrun'" in log.read_text()
    assert not (outside / "outputs").exists(), "a worker wrote outside the data root"
    assert len(output_rows(settings, res.run_id)) == 8


CONFIG = {"draft_vocab_size": 256, "max_length": 128, "batch_size": 4, "epochs": 1, "ttt_length": 2,
          "lr": 1e-3, "log_every_steps": 1, "claim_idle_s": 3.0, "poll_s": 0.2}  # fmt: skip


def _train(env, target, out, cfg, log) -> subprocess.CompletedProcess:
    cmd = regen_cmd("train", "--run", "run-p", "--target", str(target), "--out", str(out), "--config", str(cfg),
                    "--device", "cpu")  # fmt: skip
    with open(log, "a") as f:
        return subprocess.run(cmd, env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT, timeout=300)


def _event(shard_id: str, path: str) -> dict:
    """A shard_done entry as anyone who can write the stream could forge it: valid, but naming `path`."""
    return {"type": "shard_done", "run_id": "run-p", "shard_id": shard_id, "path": path, "num_rows": "8"}


def test_shard_done_entries_are_read_back_through_their_schema(settings):
    ledger = register_run(settings, "run-q", num_shards=2, rows_per_shard=1)
    event = ShardDoneEvent(run_id="run-q", shard_id=1, path="/w/x.parquet", num_rows=3, num_tokens=7)
    assert ledger.mark_shard_done(event)
    entries = [fields for _, fields in ledger.r.xrange(ledger.events_key("run-q"))]
    assert read_shard_done(entries[0]) == event
    assert read_shard_done({"type": "run_done", "run_id": "run-q"}) is None
    for bad in ("../x", "-1", ""):
        with pytest.raises(pydantic.ValidationError):
            read_shard_done(_event(bad, "x"))


def test_trainer_ignores_event_paths_and_survives_unreadable_shards(settings, settings_env, tmp_path):
    target = make_tiny_target(tmp_path / "target", layers=4, hidden=32, heads=4, kv_heads=2)
    cfg = tmp_path / "train.json"
    cfg.write_text(json.dumps(CONFIG))
    ledger = register_run(settings, "run-p", num_shards=6, rows_per_shard=8)
    rows = greedy_rows(target, "run-p", 8, new_tokens=16, seed=1)
    layout = RunLayout(Storage(settings.data_root_resolved), "run-p")
    key = ledger.events_key("run-p")
    publish_shard(settings, ledger, "run-p", 0, rows)  # a good shard
    # shard 1: good file in our root, but its event names /etc/passwd
    layout.storage.write_table_atomic(layout.output_shard(1), output_table(rows))
    ledger.r.xadd(key, _event("1", "/etc/passwd"))
    # shard 2: no file in our root; its event names a planted, valid Parquet file elsewhere
    planted = tmp_path / "planted.parquet"
    Storage(str(tmp_path)).write_table_atomic(str(planted), output_table(rows))
    ledger.r.xadd(key, _event("2", str(planted)))
    # shard 3: a file in our root that is not Parquet; shard 4: Parquet of another schema
    Path(layout.output_shard(3)).write_text("root:x:0:0:root:/root:/bin/bash\n")
    ledger.r.xadd(key, _event("3", "x"))
    import pyarrow as pa

    layout.storage.write_table_atomic(layout.output_shard(4), pa.table({"a": [1, 2]}))
    ledger.r.xadd(key, _event("4", "x"))
    ledger.r.xadd(key, _event("../x", "x"))  # malformed
    out, log = tmp_path / "out", tmp_path / "trainer.log"
    assert _train(settings_env, target, out, cfg, log).returncode == 0, log.read_text()[-3000:]
    ckpt = load_latest(out)
    assert sorted(tuple(k) for k in ckpt["consumed_shards"]) == [("run-p", 0), ("run-p", 1)]
    bad = {b["shard_id"]: b for b in ckpt["bad_shards"]}
    assert sorted(bad) == [2, 3, 4]
    assert bad[2]["path"] == layout.output_shard(2) and "FileNotFound" in bad[2]["reason"]
    assert str(planted) not in json.dumps(ckpt["bad_shards"])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted(m["bad_shard"]["shard_id"] for m in metrics if "bad_shard" in m) == [2, 3, 4]
    assert "cannot be trained on and is skipped" in log.read_text()
    assert ledger.r.xpending(key, "trainer")["pending"] == 0  # every entry acked, bad ones included
    # a restart meeting an unreadable shard already pending for it (a trainer killed before it acked)
    ledger.r.xadd(key, _event("5", "/etc/shadow"))
    Path(layout.output_shard(5)).write_bytes(b"PAR1 not really")
    ledger.r.xreadgroup("trainer", default_consumer_name(str(out)), {key: ">"}, count=1)
    assert ledger.r.xpending(key, "trainer")["pending"] == 1
    assert _train(settings_env, target, out, cfg, log).returncode == 0, log.read_text()[-3000:]
    assert ledger.r.xpending(key, "trainer")["pending"] == 0
    assert _train(settings_env, target, out, cfg, log).returncode == 0, log.read_text()[-3000:]
    ckpt = load_latest(out)
    assert sorted(b["shard_id"] for b in ckpt["bad_shards"]) == [2, 3, 4, 5]
    assert len(ckpt["consumed_shards"]) == 2
