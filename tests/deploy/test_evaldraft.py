"""eval-draft: per-source accept length against the simulator (whose accept length per prompt is set
exactly by --spec-accept-rule) and against a real vLLM serving a draft (figures checked against vLLM's
own counters over the same requests), plus each bad input's one-line message."""

from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
import yaml

from regen_service.deploy.evaldraft import load_source_prompts
from regen_service.deploy.spec_client import VLLM_ACCEPTED, VLLM_DRAFTS, prometheus_total
from regen_service.errors import ConfigError
from regen_service.state.heldout_prompts import prompt_messages
from schemas.heldout import HeldOutSplit
from tests.procs import regen_cmd, sim_server, vllm_server

SIM = (
    "--decode-tok-s",
    "400",
    "--answer-len-dist",
    "fixed",
    "--answer-len-mean",
    "60",
    "--log-level",
    "WARNING",
)
RULES = (
    "--spec-accept-length",
    "2.0",
    "--spec-accept-rule",
    "integral=3.0",
    "--spec-accept-rule",
    "python=1.5",
)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def _eval(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(regen_cmd("eval-draft", *args), capture_output=True, text=True, timeout=180,
                          env={**os.environ, **(env or {})})  # fmt: skip


@pytest.fixture
def prompts(tmp_path) -> Path:
    rows = [{"prompt": f"compute the integral number {i}", "source": "math"} for i in range(4)]
    rows += [
        {"messages": [{"role": "user", "content": f"write python code {i}"}], "source": "code"}
        for i in range(3)
    ]
    rows += [
        {"messages": [{"role": "user", "content": f"hello there {i}"}], "category": "chat"} for i in range(2)
    ]
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_per_source_figures_match_what_each_request_reported(prompts, tmp_path):
    out = tmp_path / "report.json"
    with sim_server(*SIM, *RULES) as spec, sim_server(*SIM) as base:
        r = _eval("--endpoint", spec, "--baseline", base, "--prompts", str(prompts), "--max-new-tokens", "60",
                  "--json", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr + r.stdout
    data = json.loads(out.read_text())
    assert [m["temperature"] for m in data["modes"]] == [0.0, 1.0]  # greedy and (no run) sampled at 1.0
    for mode in data["modes"]:
        got = {s["source"]: s for s in mode["sources"]}
        assert sorted(got) == ["chat", "code", "math"]  # "category" read where "source" is absent
        # 60 tokens per answer: ceil(60/L) verify passes each, so exactly L per source
        assert {s: (v["num_prompts"], v["accept_length"], v["verify_ct"]) for s, v in got.items()} == {
            "math": (4, 3.0, 80), "code": (3, 1.5, 120), "chat": (2, 2.0, 60)
        }  # fmt: skip
        overall = mode["overall"]
        assert overall["num_prompts"] == 9 and overall["accept_length"] == round(540 / 260, 4)
        assert all(s["speedup"] and s["baseline_tok_s"] for s in [*mode["sources"], overall])
    width, height = _png_size(Path(data["plot"]))
    assert Path(data["plot"]) == out.with_suffix(".png") and 600 <= width <= 2000 and 150 <= height <= 1200
    assert "math" in r.stdout and "overall" in r.stdout and "speed-up" in r.stdout  # the table


def test_an_endpoint_without_a_draft_is_one_line(prompts):
    with sim_server(*SIM) as plain:
        r = _eval("--endpoint", plain, "--prompts", str(prompts), "--max-new-tokens", "20")
    assert r.returncode != 0
    assert (
        "serves no draft" in r.stderr and "launch-sglang --draft" in r.stderr and "Traceback" not in r.stderr
    )
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_prompts_file_without_a_source_field(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "source": "x"}\n\n{"prompt": "b", "dataset": "y"}\n')
    with pytest.raises(ConfigError, match=r'p.jsonl:3: no "source" or "category" field.*--source-field NAME'):
        load_source_prompts(f)
    with pytest.raises(ConfigError, match=r'p.jsonl:1: no "dataset" field'):
        load_source_prompts(f, "dataset")
    f.write_text('{"prompt": "a", "dataset": "x"}\n{"prompt": "b", "dataset": "y"}\n')
    assert sorted(load_source_prompts(f, "dataset")) == ["x", "y"]
    r = _eval("--endpoint", "http://127.0.0.1:9", "--prompts", str(tmp_path / "p.jsonl"))
    assert r.returncode != 0 and 'no "source" or "category" field' in r.stderr, r.stderr


def test_the_prompt_is_the_conversation_up_to_the_last_user_turn():
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]  # fmt: skip
    assert [m["content"] for m in prompt_messages(msgs)] == ["a", "b", "c"]
    assert prompt_messages([{"role": "system", "content": "s"}]) is None


def _run(settings, tmp_path) -> str:
    from regen_service.produce.producer import enqueue

    big, small = tmp_path / "big.jsonl", tmp_path / "small.jsonl"
    big.write_text("".join(json.dumps({"prompt": f"compute the integral number {i}", "response": "x"}) + "\n"
                           for i in range(120)))  # fmt: skip
    small.write_text("".join(json.dumps({"prompt": f"tiny {i}", "response": "x"}) + "\n" for i in range(2)))
    mix = tmp_path / "mix.yaml"
    mix.write_text(yaml.safe_dump({
        "name": "heldout", "target": {"model": "m", "api": "chat"}, "shard_size": 40,
        "sampling": {"temperature": 0.7, "max_new_tokens": 30},
        "sources": [{"name": "big", "path": str(big), "format": "prompt_response"},
                    {"name": "small", "path": str(small), "format": "prompt_response"}],
    }))  # fmt: skip
    return enqueue(settings, str(mix)).run_id


def test_a_run_is_evaluated_on_its_held_out_prompts(settings, settings_env, tmp_path):
    run_id = _run(settings, tmp_path)
    prompts_dir = Path(settings.data_root) / "runs" / run_id / "prompts"
    rows = [r for p in sorted(prompts_dir.glob("*.parquet")) for r in pq.read_table(p).to_pylist()]

    def held(seed: int) -> dict[str, int]:
        split = HeldOutSplit(fraction=0.2, seed=seed)
        return {
            s: sum(1 for r in rows if r["source"] == s and split.holds_out(r["prompt_id"]))
            for s in ("big", "small")
        }

    # the fixture's point: a seed whose split holds out prompts of "big" but none of "small"
    seed = next(seed for seed in range(100) if held(seed)["small"] == 0 and held(seed)["big"] > 5)
    want = held(seed)
    draft = tmp_path / "draft"
    draft.mkdir()  # an exported draft whose trainer recorded its split
    (draft / "config.json").write_text(json.dumps({"regen": {"eval_fraction": 0.2, "eval_seed": seed}}))
    out = tmp_path / "r.json"
    with sim_server(*SIM, *RULES) as spec:
        r = _eval("--endpoint", spec, "--run", run_id, "--draft", str(draft), "--max-new-tokens", "60",
                  "--json", str(out), "--plot", str(tmp_path / "c.png"), env=settings_env)  # fmt: skip
        assert r.returncode == 0, r.stderr + r.stdout
        assert "no held-out prompts for small" in r.stderr and "carrying on" in r.stderr
        data = json.loads(out.read_text())
        assert data["heldout"] == {"run": run_id, "fraction": 0.2, "seed": seed}
        assert data["missing_sources"] == ["small"]
        assert [m["temperature"] for m in data["modes"]] == [0.0, 0.7]  # the run's sampling temperature
        (big,) = data["modes"][0]["sources"]
        assert big["source"] == "big" and big["num_prompts"] == want["big"] and big["accept_length"] == 3.0
        empty = _eval("--endpoint", spec, "--run", run_id, "--heldout-fraction", "0", env=settings_env)
    assert empty.returncode != 0 and "holds no chat prompt" in empty.stderr, empty.stderr


def _counters(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics").text
    return prometheus_total(text, VLLM_DRAFTS), prometheus_total(text, VLLM_ACCEPTED)


def _untrained_draft(target_dir: Path, out: Path) -> Path:
    """A draft with fresh weights for the target, exported for vLLM: what training starts from."""
    import torch

    from regen_service.draft.checkpoint import save_checkpoint
    from regen_service.draft.config import DraftConfig
    from regen_service.draft.sglang_format import default_aux_inputs
    from regen_service.train.model import Eagle3Draft
    from regen_service.train.vocab import build_vocab

    tc = json.loads((target_dir / "config.json").read_text())
    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=tc["hidden_size"], intermediate_size=tc["intermediate_size"],
                      num_attention_heads=tc["num_attention_heads"], num_key_value_heads=tc["num_key_value_heads"],
                      head_dim=tc["hidden_size"] // tc["num_attention_heads"], rms_norm_eps=tc["rms_norm_eps"],
                      rope_theta=float(tc.get("rope_theta") or 10000.0), max_position_embeddings=1024,
                      vocab_size=tc["vocab_size"], draft_vocab_size=256, target_hidden_size=tc["hidden_size"])  # fmt: skip
    draft = Eagle3Draft(cfg)
    draft.set_vocab(*build_vocab(torch.ones(tc["vocab_size"]), 256))
    layers = tc["num_hidden_layers"]
    save_checkpoint(out / "ckpt", {
        "draft_state_dict": draft.draft_state_dict(), "draft_config": cfg.to_dict(),
        "aux_layer_ids": default_aux_inputs(layers), "target_num_layers": layers, "optimizer": {},
        "scheduler": {}, "step": 0, "train_config": {}, "consumed_shards": [], "in_progress": None,
    })  # fmt: skip
    exp = subprocess.run(regen_cmd("export", str(out / "ckpt"), "--out", str(out / "draft"), "--target-config",
                                   str(target_dir), "--engine", "vllm"), capture_output=True, text=True)  # fmt: skip
    assert exp.returncode == 0, exp.stdout + exp.stderr
    return out / "draft"


@pytest.mark.engine
@pytest.mark.timeout(600)
def test_vllm_per_source_figures_are_its_own_counters_over_those_requests(tmp_path):
    from transformers import AutoTokenizer

    from regen_service.train.fixtures import make_tiny_target, random_texts

    target = make_tiny_target(tmp_path / "target", layers=6, hidden=128, heads=4, kv_heads=2,
                              embed_scale=30.0, logit_scale=30.0)  # fmt: skip
    draft = _untrained_draft(target, tmp_path)
    texts = sorted(set(random_texts(AutoTokenizer.from_pretrained(target), 6, 10, seed=7)))[:6]
    rows = [
        {"messages": [{"role": "user", "content": t}], "source": s}
        for t, s in zip(texts, ["a", "b", "c"] * 2, strict=True)
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "vllm.json"
    with vllm_server(target, tmp_path / "vllm.log", draft=str(draft), num_speculative_tokens=3) as url:
        before = _counters(url)
        r = _eval("--endpoint", url, "--prompts", str(prompts), "--temperature", "0", "--max-new-tokens", "24",
                  "--concurrency", "1", "--json", str(out))  # fmt: skip
        after = _counters(url)
        assert r.returncode == 0, r.stderr + r.stdout
        print(r.stdout)
        data = json.loads(out.read_text())
        print(json.dumps(data["modes"], indent=1))
        (mode,) = data["modes"]
        got = {s["source"]: s for s in mode["sources"]}
        assert sorted(got) == ["a", "b", "c"] and all(s["num_prompts"] == 2 for s in got.values())
        # the same requests again, one source at a time, bracketed by our own reads of the counters:
        # greedy at concurrency 1 on one engine gives the same tokens and the same drafts
        replay = {}
        for source in ("a", "b", "c"):
            c0 = _counters(url)
            for row in (x for x in rows if x["source"] == source):
                body = {"messages": row["messages"], "max_tokens": 24, "temperature": 0.0}
                httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).raise_for_status()
            c1 = _counters(url)
            replay[source] = (c1[0] - c0[0], c1[1] - c0[1])
    for source, (drafts, accepted) in replay.items():
        s = got[source]
        assert (s["drafts"], s["accepted_tokens"]) == (drafts, accepted), (source, s, replay)
        assert s["accept_length"] == round(1 + accepted / drafts, 4)
    overall = mode["overall"]
    assert overall["drafts"] == sum(d for d, _ in replay.values())
    # over the whole command the counters grew by the sources' figures plus the 8-token warm-up only
    assert 0 <= (after[0] - before[0]) - overall["drafts"] <= 8
    width, height = _png_size(Path(data["plot"]))
    assert 600 <= width <= 2000 and 150 <= height <= 1200
