"""`regen train` as real processes on a real Redis stream: a trainer killed with SIGKILL resumes and
consumes every shard exactly once; two trainers in one consumer group never take the same shard;
--follow trains shards as they land and stops once the run is done."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from regen_service.draft.checkpoint import load_latest
from regen_service.train.fixtures import greedy_rows, make_tiny_target, publish_shard, register_run
from tests.procs import regen_cmd, spawn, stop, wait_exit, wait_progress

CONFIG = {
    "draft_vocab_size": 256, "max_length": 128, "batch_size": 4, "epochs": 3, "ttt_length": 3,
    "lr": 1e-3, "checkpoint_every_steps": 2, "log_every_steps": 2, "claim_idle_s": 3.0, "poll_s": 0.3,
    # the step counts below are exact: no held-out split here (tests/train/test_eval.py covers it)
    "eval_fraction": 0.0,
}  # fmt: skip


@pytest.fixture
def tiny(tmp_path):
    target = make_tiny_target(tmp_path / "target", layers=4, hidden=32, heads=4, kv_heads=2, embed_scale=10.0)
    cfg = tmp_path / "train.yaml"
    cfg.write_text(json.dumps(CONFIG))
    return target, cfg


def _train(env, run, target, out: Path, cfg: Path, log: Path, *extra: str):
    cmd = regen_cmd(
        "train",
        "--run",
        run,
        "--target",
        str(target),
        "--out",
        str(out),
        "--config",
        str(cfg),
        "--device",
        "cpu",
        *extra,
    )
    return spawn(cmd, env=env, log=log)


def _consumed(out: Path) -> list[tuple[str, int]]:
    ckpt = load_latest(out)
    return [] if ckpt is None else [tuple(k) for k in ckpt["consumed_shards"]]


# --standalone: the rendezvous takes a free port, so a torchrun left by an earlier test (or anything else on
# 29500, torchrun's fixed default) cannot make this one fail to start.
TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
              "-m", "workers.trainer", "--"]  # fmt: skip


def _wait(proc, timeout_s: float, log: Path) -> None:
    try:  # timeout_s: how long the trainer may show no sign of life (log, CPU), not its whole run
        assert wait_exit(proc, log, stall_s=timeout_s) == 0, log.read_text()[-3000:]
    except BaseException:
        stop(proc, signal.SIGKILL)
        raise


def _published(settings, target, run: str, num_shards: int, rows_per_shard: int, seed: int):
    """A registered run with every shard published (the same greedy rows in each); its ledger."""
    ledger = register_run(settings, run, num_shards=num_shards, rows_per_shard=rows_per_shard)
    rows = greedy_rows(target, run, rows_per_shard, new_tokens=24, seed=seed)
    for shard in range(num_shards):
        publish_shard(settings, ledger, run, shard, rows)
    return ledger


def _kill_after_two_shards(proc, out: Path, log: Path) -> None:
    """SIGKILL once a checkpoint lists some shards; stuck = no new checkpoint or log line for 120 s."""
    wait_progress(lambda: (len(c := _consumed(out)) >= 2, (c, log.stat().st_size if log.exists() else 0)),
                  what="a checkpoint listing 2 shards", stall_s=120, procs=(proc,), interval_s=0.05)  # fmt: skip
    stop(proc, signal.SIGKILL)


def test_kill9_then_resume_consumes_every_shard_once(settings, settings_env, tmp_path, tiny):
    target, cfg = tiny
    ledger = _published(settings, target, "run-k", 8, 16, seed=1)
    out, log = tmp_path / "out", tmp_path / "trainer.log"
    _kill_after_two_shards(_train(settings_env, "run-k", target, out, cfg, log), out, log)
    killed_at = _consumed(out)
    assert 2 <= len(killed_at) < 8, "the trainer finished before it could be killed"
    key = ledger.events_key("run-k")
    assert ledger.r.xpending(key, "trainer")["pending"] > 0  # the shard in training was never acked

    proc = _train(settings_env, "run-k", target, out, cfg, log)
    _wait(proc, 180, log)
    consumed = _consumed(out)
    assert sorted(consumed) == [("run-k", i) for i in range(8)]  # each shard exactly once
    assert consumed[: len(killed_at)] == killed_at
    assert ledger.r.xpending(key, "trainer")["pending"] == 0
    final = load_latest(out)
    assert final["in_progress"] is None and final["step"] == 8 * 3 * 4  # no batch trained twice or skipped
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == final["step"]


def test_two_trainers_in_one_group_split_the_run_while_it_lands(settings, settings_env, tmp_path, tiny):
    target, cfg = tiny
    ledger = register_run(settings, "run-f", num_shards=6, rows_per_shard=8)
    rows = greedy_rows(target, "run-f", 8, new_tokens=24, seed=2)
    publish_shard(settings, ledger, "run-f", 0, rows)
    outs = [tmp_path / "out-a", tmp_path / "out-b"]
    procs = [
        _train(settings_env, "run-f", target, o, cfg, tmp_path / f"{o.name}.log", "--follow") for o in outs
    ]
    for shard in range(1, 6):  # the rest lands while both train
        time.sleep(0.7)
        publish_shard(settings, ledger, "run-f", shard, rows)
    for p, o in zip(procs, outs, strict=True):
        _wait(p, 180, tmp_path / f"{o.name}.log")
    a, b = (set(_consumed(o)) for o in outs)
    assert not a & b, f"shard taken twice: {a & b}"
    assert sorted(a | b) == [("run-f", i) for i in range(6)]
    assert len(_consumed(outs[0])) == len(a) and len(_consumed(outs[1])) == len(b)
    assert ledger.r.xpending(ledger.events_key("run-f"), "trainer")["pending"] == 0
    for o in outs:
        ckpt = load_latest(o)
        assert ckpt is None or ckpt["draft_state_dict"]["t2d"].dtype == torch.bool


def test_torchrun_two_ranks_share_each_shard_and_checkpoint_once(settings, settings_env, tmp_path, tiny):
    """gloo on the CPU: rank 0 reads the stream and broadcasts shards; both ranks train in lockstep."""
    target, cfg = tiny
    ledger = register_run(settings, "run-d", num_shards=3, rows_per_shard=9)
    rows = greedy_rows(target, "run-d", 9, new_tokens=16, seed=3)
    for shard in range(3):
        publish_shard(settings, ledger, "run-d", shard, rows)
    out, log = tmp_path / "out", tmp_path / "torchrun.log"
    args = [
        "--run",
        "run-d",
        "--target",
        str(target),
        "--out",
        str(out),
        "--config",
        str(cfg),
        "--device",
        "cpu",
    ]
    proc = spawn([*TORCHRUN_2, *args], env=settings_env, log=log)
    _wait(proc, 180, log)
    summaries = [json.loads(line) for line in log.read_text().splitlines() if line.startswith('{"steps"')]
    assert len(summaries) == 2 and {s["consumed"] for s in summaries} == {3}
    final = load_latest(out)
    # 9 rows, batch_size 4: rank 0 holds 5 (2 batches), rank 1 holds 4 (1 batch, then one at weight 0)
    assert final["step"] == 3 * 3 * 2 and sorted(map(tuple, final["consumed_shards"])) == [
        ("run-d", i) for i in range(3)
    ]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["world"] for r in records} == {2} and len({r["step"] for r in records}) == len(records)
    assert ledger.r.xpending(ledger.events_key("run-d"), "trainer")["pending"] == 0


def test_packed_trainer_killed_and_resumed_trains_every_sample_once(settings, settings_env, tmp_path, tiny):
    """data.packing: rows of max_length tokens, several samples each. A SIGKILL mid-run and a resume still
    train each sample exactly once per epoch (the packed batch position is resumed like any other), in
    fewer steps than one sample a row, with the schedule's length fitted to the packing."""
    target, _ = tiny
    cfg = tmp_path / "packed.yaml"
    cfg.write_text(json.dumps({**CONFIG, "packing": True, "batch_size": 1, "checkpoint_every_steps": 1}))
    _published(settings, target, "run-p", 6, 12, seed=4)
    out, log = tmp_path / "out", tmp_path / "trainer.log"
    _kill_after_two_shards(_train(settings_env, "run-p", target, out, cfg, log), out, log)
    assert 2 <= len(_consumed(out)) < 6, "the trainer finished before it could be killed"
    proc = _train(settings_env, "run-p", target, out, cfg, log)
    _wait(proc, 180, log)
    final = load_latest(out)
    assert sorted(map(tuple, final["consumed_shards"])) == [("run-p", i) for i in range(6)]
    assert final["in_progress"] is None
    assert final["samples_seen"] == 6 * 12 * 3  # every sample once per epoch: none twice, none skipped
    assert 6 * 3 <= final["step"] < 6 * 12 * 3  # a row held several samples
    # the schedule's estimate (one sample a step: 6 x 12 x 3 = 216) divided by the first shard's packing
    assert final["scheduler"]["lr_lambdas"][0]["total"] < 216
    assert "packed rows hold" in log.read_text()
