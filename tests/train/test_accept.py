"""End to end on the CPU: a tiny random Llama target answers prompts greedily, its answers land as
output shards with shard_done events, `train_from_run` trains the draft from the stream, and the
speculative check shows the draft's accept length rising from ~1.0 to well above it."""

from __future__ import annotations

import json

import pytest
import torch

from regen_service.draft.checkpoint import REQUIRED_KEYS, load_latest
from regen_service.draft.config import DraftConfig
from regen_service.train.accept import accept_length
from regen_service.train.config import TrainConfig
from regen_service.train.fixtures import (
    greedy_rows,
    make_tiny_target,
    publish_shard,
    random_prompts,
    register_run,
)
from regen_service.train.loop import train_from_run
from regen_service.train.model import Eagle3Draft
from regen_service.train.target import HFTarget
from tests.train.test_units import SGLANG_KEYS


def _draft(ckpt: dict, target: HFTarget, trained: bool) -> Eagle3Draft:
    draft = Eagle3Draft(DraftConfig.from_dict(ckpt["draft_config"]))
    draft.embed_tokens.weight.data.copy_(target.embed_weight)
    sd = ckpt["draft_state_dict"]
    if trained:
        draft.load_state_dict(sd, strict=False)
    else:  # a fresh draft with the same (frozen) vocabulary: what training started from
        draft.set_vocab(sd["d2t"], sd["t2d"])
    return draft


@pytest.mark.slow  # trains a draft for about a minute on the CPU: the full suite's, not the fast lane's
def test_training_raises_accept_length(settings, tmp_path):
    torch.manual_seed(0)
    # logit_scale: a peaked next-token distribution, as a trained LLM has (a random head spreads it near
    # uniformly, leaving the soft targets, the default objective, nothing to learn from)
    target_dir = make_tiny_target(tmp_path / "target", embed_scale=10.0, logit_scale=30.0)
    ledger = register_run(settings, "run-a", num_shards=3, rows_per_shard=48)
    for shard in range(3):
        publish_shard(
            settings,
            ledger,
            "run-a",
            shard,
            greedy_rows(target_dir, "run-a", 48, new_tokens=40, seed=100 + shard),
        )
    cfg = TrainConfig(
        draft_vocab_size=512, max_length=256, batch_size=12, epochs=4, lr=2e-3, ttt_length=4,
        warmup_ratio=0.05, log_every_steps=8,
    )  # fmt: skip
    summary = train_from_run(settings, "run-a", str(target_dir), str(tmp_path / "out"), cfg, device="cpu")
    assert summary["consumed"] == 3 and summary["steps"] == 3 * 4 * 4

    ckpt = load_latest(tmp_path / "out")
    assert set(REQUIRED_KEYS) <= set(ckpt)
    assert set(ckpt["draft_state_dict"]) == SGLANG_KEYS
    assert ckpt["aux_layer_ids"] == [1, 2, 3] and ckpt["target_num_layers"] == 4  # distinct (issue 9)
    assert ckpt["draft_config"]["vocab_size"] == 6000 and ckpt["draft_config"]["draft_vocab_size"] == 512
    assert sorted(map(tuple, ckpt["consumed_shards"])) == [("run-a", i) for i in range(3)]
    assert ckpt["in_progress"] is None and ckpt["train_config"]["epochs"] == 4
    assert ledger.r.xpending(ledger.events_key("run-a"), "trainer")["pending"] == 0

    log = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"]

    target = HFTarget(str(target_dir))
    held_out = random_prompts(target_tok(target_dir), 6, 12, seed=999)  # prompts never trained on
    before = accept_length(target, _draft(ckpt, target, trained=False), held_out, k=3, max_new_tokens=20)
    after = accept_length(target, _draft(ckpt, target, trained=True), held_out, k=3, max_new_tokens=20)
    print(f"accept length: init {before['accept_length']:.3f} -> trained {after['accept_length']:.3f}")
    assert before["accept_length"] < 1.1
    assert after["accept_length"] >= 1.5


def target_tok(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
