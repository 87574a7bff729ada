"""Two training choices on the CPU at the same budget: accept length of the drafts each one trains.

`--compare target` (the default): soft vs hard targets, Llama-style drafts. `--compare arch`: the
Llama-style draft vs the MLA draft (draft_arch "mla"), both on soft targets.

A tiny random Llama target (fixtures.make_tiny_target) answers prompts sampled at temperature 1 (with
greedy answers the two objectives share their argmax everywhere), the same rows are published to two
runs, a draft is trained from each with the same config (seed, steps, lr) but `target` soft or hard,
and both are measured with accept.accept_length on held-out prompts (greedy verify, k 3). Needs Redis
(REGEN_REDIS_URL, default 127.0.0.1:6379; keys under a private prefix, deleted after). Prints JSON.
  PYTHONPATH=. python scripts/compare_targets.py [--compare target|arch] [--epochs 4] [--temperature 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import uuid
from pathlib import Path

import redis
import torch

from regen_service.draft.checkpoint import load_latest
from regen_service.draft.config import DraftConfig
from regen_service.settings import Settings
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

# what each comparison trains: label -> the TrainConfig fields that differ
CHOICES = {
    "target": {"soft": {"target": "soft"}, "hard": {"target": "hard"}},
    "arch": {"llama": {"draft_arch": "llama"}, "mla": {"draft_arch": "mla"}},
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--compare", choices=sorted(CHOICES), default="target")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--shards", type=int, default=3)
    # a random head spreads the target's distribution near uniformly (entropy ~ln V: nothing for soft targets
    # to learn); 30 gives top-1 probability ~0.43, entropy ~2.4 nats, closer to a trained LLM's
    p.add_argument("--logit-scale", type=float, default=30.0)
    a = p.parse_args()
    torch.manual_seed(0)
    root = Path(tempfile.mkdtemp(prefix="regen-targets-"))
    prefix = f"regen-cmp-{uuid.uuid4().hex[:8]}"
    s = Settings(redis_url=os.environ.get("REGEN_REDIS_URL", "redis://127.0.0.1:6379/0"),
                 data_root=str(root / "data"), key_prefix=prefix)  # fmt: skip
    target_dir = make_tiny_target(root / "target", embed_scale=10.0, logit_scale=a.logit_scale)
    shards = [greedy_rows(target_dir, "x", 48, new_tokens=40, seed=100 + i, temperature=a.temperature)
              for i in range(a.shards)]  # fmt: skip
    target = HFTarget(str(target_dir))
    from transformers import AutoTokenizer

    held_out = random_prompts(
        AutoTokenizer.from_pretrained(target_dir, local_files_only=True), 6, 12, seed=999
    )
    result = {
        "temperature": a.temperature,
        "logit_scale": a.logit_scale,
        "compare": a.compare,
        "epochs": a.epochs,
        "shards": a.shards,
    }
    try:
        for mode, fields in CHOICES[a.compare].items():
            run = f"run-{mode}"
            ledger = register_run(s, run, num_shards=a.shards, rows_per_shard=48)
            for i, rows in enumerate(shards):
                publish_shard(s, ledger, run, i, [{**r, "run_id": run} for r in rows])
            cfg = TrainConfig(
                draft_vocab_size=512, max_length=256, batch_size=12, epochs=a.epochs, lr=2e-3, ttt_length=4,
                warmup_ratio=0.05, log_every_steps=8, **fields,
            )  # fmt: skip
            t0 = time.time()
            summary = train_from_run(s, run, str(target_dir), str(root / mode), cfg, device="cpu")
            ckpt = load_latest(root / mode)
            draft = Eagle3Draft(DraftConfig.from_dict(ckpt["draft_config"]))
            draft.embed_tokens.weight.data.copy_(target.embed_weight)
            draft.load_state_dict(ckpt["draft_state_dict"], strict=False)
            acc = accept_length(target, draft, held_out, k=3, max_new_tokens=20)
            result[mode] = {"steps": summary["steps"], "train_s": round(time.time() - t0, 1),
                            "accept_length": round(acc["accept_length"], 4), "verify_steps": acc["verify_steps"]}  # fmt: skip
    finally:
        r = redis.Redis.from_url(s.redis_url)
        keys = list(r.scan_iter(f"{prefix}*"))
        if keys:
            r.delete(*keys)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
