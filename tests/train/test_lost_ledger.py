"""Training survives a lost ledger: Redis wiped under a running `regen train --follow` (no NOGROUP
crash), `regen resume` announces every finished shard again from storage, and the trainer consumes
each shard once; without --follow a trainer that never saw some finished shards does not end "done".
Real processes on a real Redis stream, shards read back from Parquet."""

from __future__ import annotations

import os
import subprocess

from regen_service.state.storage import RunLayout, Storage
from regen_service.train.fixtures import greedy_rows, output_table, publish_shard, register_run
from tests.e2e.test_exactly_once import wipe
from tests.procs import regen_cmd, stop, wait_exit, wait_progress
from tests.train.test_consumer import _consumed, _train, _wait, tiny  # noqa: F401 - tiny is a fixture


def _log_says(log, text: str):
    return lambda: (log.exists() and text in log.read_text(), log.stat().st_size if log.exists() else 0)


def test_redis_wipe_during_follow_then_resume(settings, settings_env, tmp_path, tiny):  # noqa: F811
    target, cfg = tiny
    ledger = register_run(settings, "run-w", num_shards=6, rows_per_shard=8)
    rows = greedy_rows(target, "run-w", 8, new_tokens=24, seed=3)
    for shard in range(3):
        publish_shard(settings, ledger, "run-w", shard, rows)
    out, log = tmp_path / "out", tmp_path / "trainer.log"
    proc = _train(settings_env, "run-w", target, out, cfg, log, "--follow")
    try:
        wait_progress(lambda: (len(c := _consumed(out)) >= 1, (c, log.stat().st_size if log.exists() else 0)),
                      what="a first checkpoint", stall_s=120, procs=(proc,), interval_s=0.1)  # fmt: skip
        assert wipe(settings) > 0  # the ledger, the stream and its consumer group: all gone
        # The rest finishes while Redis knows nothing of the run: in storage only.
        layout = RunLayout(Storage(settings.data_root_resolved), "run-w")
        for shard in range(3, 6):
            layout.storage.write_table_atomic(layout.output_shard(shard), output_table(rows))
        # The trainer lives on and says what it waits for, instead of a NOGROUP traceback or silence.
        wait_progress(_log_says(log, "regen resume run-w"), what="the trainer naming resume", stall_s=120,
                      procs=(proc,))  # fmt: skip
        env = {**os.environ, **settings_env}
        out_resume = subprocess.run(regen_cmd("resume", "run-w"), env=env, capture_output=True, text=True)
        assert out_resume.returncode == 0, out_resume.stderr
        _wait(proc, 180, log)
    finally:
        stop(proc)
    consumed = _consumed(out)
    assert sorted(consumed) == [("run-w", i) for i in range(6)], consumed  # each shard, exactly once
    assert "NOGROUP" not in log.read_text()
    assert ledger.event_stream("run-w", "trainer").pending() == 0


def test_without_follow_unannounced_shards_are_not_done(settings, settings_env, tmp_path, tiny):  # noqa: F811
    target, cfg = tiny
    ledger = register_run(settings, "run-u", num_shards=3, rows_per_shard=8)
    rows = greedy_rows(target, "run-u", 8, new_tokens=24, seed=4)
    publish_shard(settings, ledger, "run-u", 0, rows)
    layout = RunLayout(Storage(settings.data_root_resolved), "run-u")
    for shard in (1, 2):  # finished, but their events were lost with the ledger
        layout.storage.write_table_atomic(layout.output_shard(shard), output_table(rows))
    out, log = tmp_path / "out", tmp_path / "trainer.log"
    proc = _train(settings_env, "run-u", target, out, cfg, log)
    assert wait_exit(proc, log, stall_s=180) == 1
    text = log.read_text()
    assert "shards [1, 2] of run run-u are finished in storage but were never on its event stream" in text
    assert "regen resume run-u" in text
    assert _consumed(out) == [("run-u", 0)]
