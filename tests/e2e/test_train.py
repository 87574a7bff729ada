"""The whole story on the CPU: a tiny random-weight target answers a mix through the real pipeline
(producer -> Redis -> Celery worker -> the simulator serving that target greedily over HTTP), the
trainer consumes the run's shard_done stream as a real process, the checkpoint is exported in SGLang's
format and passes validate-draft, and the draft's accept length rises clearly above its start (~1.0)."""

from __future__ import annotations

import json
import os
import random
import subprocess

import pytest
import torch
import yaml

from regen_service.draft.checkpoint import load_latest
from regen_service.produce.producer import enqueue
from regen_service.train.accept import accept_length
from regen_service.train.fixtures import make_tiny_target, random_prompts
from regen_service.train.target import HFTarget
from tests.procs import regen_cmd, sim_server, wait_run_done, worker_process
from tests.train.test_accept import _draft


@pytest.mark.slow
@pytest.mark.timeout(900)  # a pipeline run plus 12 epochs: past the default 300 s on a busy 2-core box
@pytest.mark.parametrize("draft_arch", ["llama", "mla"])
def test_pipeline_data_trains_a_draft_that_accepts(settings, settings_env, tmp_path, draft_arch):
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    # logit_scale: a peaked next-token distribution, as a trained LLM has (a random head spreads it near
    # uniformly, leaving the soft targets, the default objective, nothing to learn from)
    target_dir = make_tiny_target(tmp_path / "target", embed_scale=10.0, logit_scale=30.0)
    tok = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    # prompts: random plain-token text, the same token pool the held-out check draws from
    rng = random.Random(1)
    pool_prompts = random_prompts(tok, 144, 12, seed=5)
    texts = {tok.decode(p[-12 - 3 : -3]) for p in pool_prompts} | {
        f"item {rng.random():.6f}" for _ in range(4)
    }
    # two sources, so the held-out evaluation reports each
    sources = []
    for name, part in (("tiny", sorted(texts)[0::2]), ("tiny-b", sorted(texts)[1::2])):
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in part))
        sources.append({"name": name, "path": str(data), "format": "prompt_response"})
    mix = tmp_path / "tiny.yaml"
    mix.write_text(yaml.safe_dump({
        "name": "tiny-e2e", "target": {"model": "tiny-llama", "api": "generate", "tokenizer": str(target_dir)},
        "sampling": {"temperature": 0.0, "max_new_tokens": 40}, "regenerate": {"turns": "last", "thinking": "off"},
        "shard_size": 50, "sources": sources,
    }))  # fmt: skip
    res = enqueue(settings, mix)
    sim = ("--hf-model", str(target_dir), "--tokenizer", str(target_dir), "--model", "tiny-llama",
           "--decode-tok-s", "0", "--answer-len-max", "40")  # fmt: skip
    with (
        sim_server(*sim, log=tmp_path / "sim.log") as url,
        worker_process(settings_env, url, log=tmp_path / "w.log") as w,
    ):
        wait_run_done(settings, res.run_id, procs=(w,), timeout_s=240)

    cfg = tmp_path / "train.yaml"
    cfg.write_text(yaml.safe_dump({
        "draft_vocab_size": 512, "max_length": 256, "batch_size": 12, "epochs": 12, "lr": 2e-3, "ttt_length": 4,
        "warmup_ratio": 0.05, "log_every_steps": 8, "draft_arch": draft_arch,
        "eval_fraction": 0.1, "eval_every_steps": 24, "eval_max_samples": 32,
    }))  # fmt: skip
    env = {**os.environ, **settings_env}
    out = tmp_path / "out"
    train = regen_cmd("train", "--run", res.run_id, "--target", str(target_dir), "--out", str(out),
                      "--config", str(cfg), "--device", "cpu")  # fmt: skip
    done = subprocess.run(train, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    # held-out evaluation: the table on stderr, per source, and the best checkpoint beside the latest
    progress = [line for line in done.stderr.splitlines() if "progress: step" in line]
    table = done.stderr[done.stderr.rindex("\nheld-out eval at step") + 1 :] if summary["eval"] else ""
    evals = [line for line in done.stderr.splitlines() if "monitor: held-out eval at step" in line]
    print(progress[-1] if progress else "(no progress line)", *evals, table, sep="\n")
    assert progress and "eval accept@3" in progress[-1]
    assert set(summary["eval"]["sources"]) == {"tiny", "tiny-b"} and "tiny-b" in table
    assert summary["best"]["accept_length"] >= summary["eval"]["accept_length"]["3"] > 1.2
    assert (out / "checkpoints" / "best").exists() and list((out / "tb").glob("events.out.tfevents.*"))
    ckpt = load_latest(out)
    assert sorted(s for _, s in ckpt["consumed_shards"]) == list(range(res.num_shards))

    draft_dir = tmp_path / "draft"
    exp = subprocess.run(
        regen_cmd("export", str(out), "--out", str(draft_dir)), env=env, capture_output=True, text=True
    )
    assert exp.returncode == 0, exp.stdout + exp.stderr
    val = subprocess.run(regen_cmd("validate-draft", str(draft_dir), "--target-config", str(target_dir)), env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert val.returncode == 0, val.stdout + val.stderr
    config = json.loads((draft_dir / "config.json").read_text())
    arch = {"llama": "LlamaForCausalLMEagle3", "mla": "Eagle3DeepseekV2ForCausalLM"}[draft_arch]
    assert config["architectures"] == [arch] and config["draft_vocab_size"] == 512

    target = HFTarget(str(target_dir))
    held_out = random_prompts(tok, 6, 12, seed=999)
    before = accept_length(target, _draft(ckpt, target, trained=False), held_out, k=3, max_new_tokens=20)
    after = accept_length(target, _draft(ckpt, target, trained=True), held_out, k=3, max_new_tokens=20)
    print(
        f"accept length through the pipeline ({draft_arch}): init {before['accept_length']:.3f} -> trained {after['accept_length']:.3f}"
    )
    assert before["accept_length"] < 1.1
    assert after["accept_length"] >= 1.5
