"""Held-out evaluation while training (issue 19), on the CPU with real Redis streams and real Parquet shards.

The split never trains on a held-out prompt and does not move with shard cuts, restarts or world size; the
evaluator's simulated accept length replays to exactly what greedy speculative decoding (train/accept.py)
measures on the same draft and held-out prompts; the checkpoint marked `best` is the step whose eval was
best and survives pruning; a flat target (an unscaled random head) draws the not-learning warning; the
TensorBoard event files read back with tensorboard's own EventAccumulator.
"""

from __future__ import annotations

import json
import logging
import math

import pyarrow as pa
import pytest
import torch

from regen_service.draft.checkpoint import best_path, load_checkpoint, load_latest
from regen_service.errors import ConfigError
from regen_service.train.accept import accept_length
from regen_service.train.config import TrainConfig
from regen_service.train.eval_set import EvalSet, split_table
from regen_service.train.evaluate import chain_stats, format_table
from regen_service.train.fixtures import (
    greedy_rows,
    make_tiny_target,
    output_table,
    publish_shard,
    register_run,
)
from regen_service.train.loop import train_from_run
from regen_service.train.monitor import batch_samples
from regen_service.train.progress import not_learning
from regen_service.train.target import HFTarget
from schemas.heldout import HeldOutSplit
from tests.train.test_accept import _draft


def _rows(n: int, sources=("a", "b")) -> list[dict]:
    return [{"prompt_id": f"pid-{i}", "source": sources[i % len(sources)], "run_id": "r"} for i in range(n)]


def test_split_is_disjoint_and_does_not_move_with_shard_cuts():
    split = HeldOutSplit(fraction=0.2, seed=7)
    table = output_table(_rows(400))
    train, held, trained = split_table(table, split)
    held_ids = {p for t in held.values() for p in t.column("prompt_id").to_pylist()}
    train_ids = set(train.column("prompt_id").to_pylist())
    assert not held_ids & train_ids and len(held_ids | train_ids) == 400
    assert 40 <= len(held_ids) <= 120  # 20% of 400 in expectation
    assert sum(trained.values()) == len(train_ids) and set(held) == {"a", "b"}
    # the same prompts held out whatever the shard cut (a world size or restart reads other cuts)
    again = set()
    for lo in range(0, 400, 37):
        _, h, _ = split_table(table.slice(lo, 37), split)
        again |= {p for t in h.values() for p in t.column("prompt_id").to_pylist()}
    assert again == held_ids
    assert {p for p in held_ids} == {f"pid-{i}" for i in range(400) if split.holds_out(f"pid-{i}")}
    # another seed holds out other prompts; fraction 0 none; a row without a prompt id is trained on
    other = split_table(table, HeldOutSplit(fraction=0.2, seed=8))[1]
    assert {p for t in other.values() for p in t.column("prompt_id").to_pylist()} != held_ids
    assert split_table(table, HeldOutSplit(fraction=0.0))[1] == {}
    bare = pa.table({"x": [1, 2]})
    assert split_table(bare, split)[0].num_rows == 2


def test_eval_set_is_bounded_and_round_trips_through_a_checkpoint_state():
    cfg = TrainConfig(eval_fraction=0.5, eval_max_samples=3, eval_max_length=8)
    es = EvalSet(cfg)

    class Ex:
        def __init__(self, n):
            self.ids, self.mask = torch.arange(n), torch.ones(n, dtype=torch.int64)

    es.add({"b": [Ex(12), Ex(12)], "a": [Ex(3), Ex(1)]}, {"a": 5, "c": 2}, {"a": 2, "b": 2})
    assert [(s.source, s.ids.numel()) for s in es.samples] == [
        ("a", 3),
        ("b", 8),
        ("b", 8),
    ]  # a 1-token one dropped
    again = EvalSet(cfg)
    again.load(es.state(), "out", had_ckpt=True)
    assert [(s.source, s.ids.tolist()) for s in again.samples] == [
        (s.source, s.ids.tolist()) for s in es.samples
    ]
    with pytest.raises(ConfigError, match=r"eval_fraction: 0\.5 and eval_seed: 0"):
        EvalSet(cfg.model_copy(update={"eval_seed": 3})).load(es.state(), "out", had_ckpt=True)
    assert batch_samples(9, 4, 2, 0) == 8 and batch_samples(9, 4, 2, 1) == 1


def test_not_learning_verdict_names_the_flat_target_first():
    res = {"ln_draft_vocab": math.log(512), "accept_length": {"1": 1.0, "2": 1.01, "3": 1.01},
           "loss_per_step": [6.2, 6.2, 6.2], "target_entropy": 6.1, "oov_share": 0.0}  # fmt: skip
    v = not_learning(res, 3, [1, 2, 3], 4, {"coverage": 1.0})
    assert v and "flat target" in v["likely_causes"][0] and "<- likely" in v["likely_causes"][0]
    ok = dict(
        res, accept_length={"1": 1.6, "2": 1.9, "3": 2.1}, loss_per_step=[2.0, 2.5, 3.0], target_entropy=1.2
    )
    assert not_learning(ok, 3, [1, 2, 3], 4, None) is None


def _replay(lead: torch.Tensor, start: int, k: int, max_new: int) -> tuple[int, int]:
    """Greedy chain decoding read off the per-position leads: verify at t accepts min(lead, k), jumps a+1."""
    t = start
    tokens = steps = 0
    while tokens < max_new:
        a = min(int(lead[t]), k)
        tokens, steps, t = tokens + a + 1, steps + 1, t + a + 1
    return tokens, steps


@pytest.mark.slow
def test_eval_while_training_best_checkpoint_tensorboard_and_decoding_agree(settings, tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.manual_seed(0)
    target_dir = make_tiny_target(tmp_path / "target", embed_scale=10.0, logit_scale=30.0)
    ledger = register_run(settings, "run-e", num_shards=2, rows_per_shard=48)
    split = HeldOutSplit(fraction=0.15, seed=0)
    for shard in range(2):
        rows = greedy_rows(target_dir, "run-e", 48, new_tokens=40, seed=200 + shard)
        for i, r in enumerate(rows):
            r["source"] = ("chat", "code")[i % 2]
        publish_shard(settings, ledger, "run-e", shard, rows)
    held_ids = {f"p{200 + s}-{i}" for s in range(2) for i in range(48) if split.holds_out(f"p{200 + s}-{i}")}
    cfg = TrainConfig(
        draft_vocab_size=512, max_length=256, batch_size=12, epochs=4, lr=2e-3, ttt_length=4, warmup_ratio=0.05,
        log_every_steps=4, eval_fraction=0.15, eval_every_steps=6, eval_max_samples=64, keep_checkpoints=1,
    )  # fmt: skip
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO):
        summary = train_from_run(settings, "run-e", str(target_dir), str(out), cfg, device="cpu")
    ckpt = load_latest(out)
    samples = ckpt["eval"]["set"]["samples"]
    assert len(samples) == summary["eval"]["samples"] == len(held_ids) > 0
    assert {s["source"] for s in samples} == {"chat", "code"} == set(summary["eval"]["sources"])
    assert summary["samples"] == 4 * (
        96 - len(held_ids)
    )  # every trained sample once per epoch, none held out
    print(format_table(summary["eval"], summary["best"]))
    progress = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress: step")]
    print(progress[-1])
    assert "samples" in progress[-1] and "tok/s" in progress[-1] and "eval accept@3" in progress[-1]

    # TensorBoard: read back with tensorboard's own reader; the best step is the argmax of its eval scalar
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    print("tensorboard scalars:", sorted(tags))
    for t in ("train/loss", "train/acc_0", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/samples",
              "train/shards_consumed", "eval/loss", "eval/acc_3", "eval/accept_length_k3", "eval/target_entropy",
              "eval/source/chat/accept_length_k3", "eval/source/code/acc_0"):  # fmt: skip
        assert t in tags, t
    evals = {e.step: e.value for e in acc.Scalars("eval/accept_length_k3")}
    assert len(evals) >= 3
    best_step = max(evals, key=lambda s: (evals[s], -s))
    best = load_checkpoint(best_path(out))
    assert best["step"] == best_step == summary["best"]["step"]
    assert abs(best["eval"]["best"]["accept_length"] - evals[best_step]) < 1e-4
    assert summary["checkpoint"] == f"step-{ckpt['step']:08d}" and (out / "checkpoints" / "best").exists()
    assert summary["not_learning"] is None

    # the evaluator's chains against real greedy speculative decoding, same draft, same held-out prompts
    target = HFTarget(str(target_dir))
    draft = _draft(best, target, trained=True).eval()
    k, max_new = 3, 20
    decoded = sim_tokens = sim_steps = 0.0
    prompts = []
    for s in samples[:8]:
        ids, mask = s["ids"].long()[None], s["mask"].long()[None]
        aux, tgt, _ = target.states(ids, torch.ones_like(ids))
        st = chain_stats(draft, aux, ids, tgt, mask, 4)
        p = int((mask[0] == 0).sum())  # the prompt: everything before the first answer token
        tok, steps = _replay(st["lead"][0], p - 1, k, max_new)
        sim_tokens, sim_steps = sim_tokens + tok, sim_steps + steps
        prompts.append(ids[0, :p].tolist())
    decoded = accept_length(target, draft, prompts, k=k, max_new_tokens=max_new)
    replayed = sim_tokens / sim_steps
    simulated = best["eval"]["best"]["accept_length"]
    print(f"accept length k=3: decoded {decoded['accept_length']:.4f}, replayed from the evaluator's chains "
          f"{replayed:.4f}, simulated over all held-out positions {simulated:.4f}")  # fmt: skip
    assert decoded["accept_length"] > 1.3
    assert abs(replayed - decoded["accept_length"]) < 1e-6
    assert abs(simulated - decoded["accept_length"]) < 0.25 * decoded["accept_length"]

    # a restart with another split is refused before any training, with the fields to set
    with pytest.raises(ConfigError, match=r"eval_fraction: 0\.15 and eval_seed: 0"):
        train_from_run(settings, "run-e", str(target_dir), str(out), cfg.model_copy(update={"eval_seed": 1}),
                       device="cpu")  # fmt: skip


@pytest.mark.slow
def test_flat_target_warns_and_a_source_without_held_out_prompts_is_named(settings, tmp_path, caplog):
    torch.manual_seed(0)
    # an unscaled head (logit_scale 1, not the fixture's default 30): entropy ~ ln V
    target_dir = make_tiny_target(tmp_path / "target", embed_scale=10.0, logit_scale=1.0)
    ledger = register_run(settings, "run-flat", num_shards=1, rows_per_shard=40)
    rows = greedy_rows(target_dir, "run-flat", 40, new_tokens=24, seed=3)
    split = HeldOutSplit(fraction=0.3, seed=0)
    rare = next(r for r in rows if not split.holds_out(r["prompt_id"]))
    rare["source"] = "rare"  # one prompt, trained on: its held-out split is empty
    publish_shard(settings, ledger, "run-flat", 0, rows)
    cfg = TrainConfig(
        draft_vocab_size=256, max_length=128, batch_size=8, epochs=6, lr=2e-3, ttt_length=3, warmup_ratio=0.05,
        log_every_steps=4, eval_fraction=0.3, eval_every_steps=8, report_to=["tensorboard", "wandb"],
    )  # fmt: skip
    with caplog.at_level(logging.INFO):
        summary = train_from_run(
            settings, "run-flat", str(target_dir), str(tmp_path / "out"), cfg, device="cpu"
        )
    text = "\n".join(r.getMessage() for r in caplog.records)
    ev = summary["eval"]
    print(format_table(ev, summary["best"]))
    assert ev["target_entropy"] > 0.9 * ev["ln_draft_vocab"]  # the random head: flat over the draft vocab
    assert summary["not_learning"] and "flat target" in summary["not_learning"]["likely_causes"][0]
    warn = [r for r in caplog.records if r.levelno == logging.WARNING and "NOT LEARNING" in r.getMessage()]
    assert warn and "<- likely" in warn[0].getMessage()
    assert "source 'rare' has no held-out prompt" in text and "raise eval_fraction" in text
    assert summary["eval_missing_sources"] == ["rare"]
    # wandb is an extra that is not installed here: one line, and TensorBoard carries on
    assert "pip install 'regen[wandb]'" in text and summary["tracking"] == ["tensorboard"]
    assert json.dumps(summary, default=str)


def test_pruning_keeps_the_best_step_directory(tmp_path):
    from regen_service.draft.checkpoint import REQUIRED_KEYS, mark_best, save_checkpoint

    for step in range(1, 6):
        save_checkpoint(tmp_path, {**dict.fromkeys(REQUIRED_KEYS), "step": step}, keep=1)
        if step == 2:
            mark_best(tmp_path, "step-00000002")
    left = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert left == ["step-00000002", "step-00000005"]
    assert best_path(tmp_path) == tmp_path / "checkpoints" / "step-00000002" / "state.pt"


def test_torchrun_two_ranks_score_the_same_held_out_set_as_one(settings, settings_env, tmp_path):
    """gloo on the CPU: both ranks hold the same eval set, score their stride shares and all-reduce; the set
    (and so the split) is the one a single process keeps."""
    from tests.procs import spawn
    from tests.train.test_consumer import TORCHRUN_2, _train, _wait

    target = make_tiny_target(tmp_path / "target", layers=4, hidden=32, heads=4, kv_heads=2, embed_scale=10.0)
    cfg = tmp_path / "train.yaml"
    cfg.write_text(json.dumps({
        "draft_vocab_size": 256, "max_length": 128, "batch_size": 4, "epochs": 1, "ttt_length": 3, "lr": 1e-3,
        "log_every_steps": 2, "eval_fraction": 0.3, "eval_every_steps": 2, "poll_s": 0.3,
    }))  # fmt: skip
    ledger = register_run(settings, "run-w", num_shards=2, rows_per_shard=12)
    for shard in range(2):
        publish_shard(
            settings, ledger, "run-w", shard, greedy_rows(target, "run-w", 12, new_tokens=16, seed=shard)
        )
    args = ["--run", "run-w", "--target", str(target), "--config", str(cfg), "--device", "cpu"]
    log2 = tmp_path / "torchrun.log"
    _wait(spawn([*TORCHRUN_2, *args, "--out", str(tmp_path / "out2"), "--group", "g2"], env=settings_env, log=log2),
          240, log2)  # fmt: skip
    log1 = tmp_path / "one.log"
    _wait(_train(settings_env, "run-w", target, tmp_path / "out1", cfg, log1, "--group", "g1"), 240, log1)
    summaries = [json.loads(line) for line in log2.read_text().splitlines() if line.startswith('{"steps"')]
    assert len(summaries) == 2
    main = next(s for s in summaries if "eval" in s)
    split = HeldOutSplit(fraction=0.3, seed=0)
    held = [f"p{s}-{i}" for s in range(2) for i in range(12) if split.holds_out(f"p{s}-{i}")]
    assert main["eval"]["samples"] == len(held) > 0 and main["eval"]["accept_length"]["3"] >= 1.0
    sets = [load_latest(tmp_path / o)["eval"]["set"] for o in ("out1", "out2")]
    assert [s["ids"].tolist() for s in sets[0]["samples"]] == [s["ids"].tolist() for s in sets[1]["samples"]]
    assert sets[0]["split"] == sets[1]["split"] == split.model_dump()
    assert "held-out eval at step" in log2.read_text()  # the table, printed once by rank 0
