"""Export of trainer checkpoints and validation of drafts: the good path, and one planted draft per way
SGLang would load a draft silently wrong (each must be refused with its own message and fix)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from regen_service.cli import main
from regen_service.draft.sglang_format import default_aux_inputs
from tests.procs import regen_cmd

H, INTER, HEADS, KV, HD = 64, 128, 4, 2, 64  # head dim 64: one FlashInfer serves
VOCAB, DRAFT_VOCAB, LAYERS = 500, 128, 12


def draft_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.02  # noqa: E731
    hot = torch.sort(torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB]).values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[hot] = True
    return {
        "fc.weight": r(H, 3 * H),
        "midlayer.self_attn.q_proj.weight": r(HEADS * HD, 2 * H),
        "midlayer.self_attn.k_proj.weight": r(KV * HD, 2 * H),
        "midlayer.self_attn.v_proj.weight": r(KV * HD, 2 * H),
        "midlayer.self_attn.o_proj.weight": r(H, HEADS * HD),
        "midlayer.mlp.gate_proj.weight": r(INTER, H),
        "midlayer.mlp.up_proj.weight": r(INTER, H),
        "midlayer.mlp.down_proj.weight": r(H, INTER),
        "midlayer.hidden_norm.weight": torch.ones(H),
        "midlayer.input_layernorm.weight": torch.ones(H),
        "midlayer.post_attention_layernorm.weight": torch.ones(H),
        "norm.weight": torch.ones(H),
        "lm_head.weight": r(DRAFT_VOCAB, H),
        "d2t": hot - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }


def layer_config() -> dict:
    return {
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HD,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "vocab_size": VOCAB,
    }


def make_checkpoint(out: Path, tensors: dict | None = None, step: int = 123) -> Path:
    """The trainer's contract: OUT/checkpoints/step-NNNNNNNN/state.pt and checkpoints/latest."""
    step_dir = out / "checkpoints" / f"step-{step:08d}"
    step_dir.mkdir(parents=True)
    state = {
        "draft_state_dict": tensors if tensors is not None else draft_tensors(),
        "draft_config": {**layer_config(), "draft_vocab_size": DRAFT_VOCAB, "target_hidden_size": H},
        "aux_layer_ids": default_aux_inputs(LAYERS),
        "target_num_layers": LAYERS,
        "optimizer": {"state": {}, "param_groups": [{"lr": 1e-4}]},
        "step": step,
        "shards": ["shard-00001"],
    }
    torch.save(state, step_dir / "state.pt")
    (out / "checkpoints" / "latest").write_text(step_dir.name + "\n")
    return step_dir


def make_target(root: Path, hidden: int = H, layers: int = LAYERS, vocab: int = VOCAB) -> Path:
    """A Kimi-K2.5-shaped multimodal target config: the text model's numbers under text_config."""
    root.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": {"hidden_size": hidden, "num_hidden_layers": layers, "vocab_size": vocab},
        "vision_config": {"hidden_size": 1152},
    }
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture
def exported(tmp_path) -> tuple[Path, Path]:
    make_checkpoint(tmp_path / "train")
    target = make_target(tmp_path / "target")
    res = cli(
        "export", str(tmp_path / "train"), "--out", str(tmp_path / "draft"), "--target-config", str(target)
    )
    assert res.exit_code == 0, res.output
    return tmp_path / "draft", target


def test_export_writes_sglang_format_and_validates(exported, tmp_path):
    draft, target = exported
    assert sorted(p.name for p in draft.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    assert cfg["vocab_size"] == VOCAB and cfg["draft_vocab_size"] == DRAFT_VOCAB
    assert cfg["tie_word_embeddings"] is False and cfg["target_hidden_size"] == H
    # Captured inputs [2, 6, 9] are written as SGLang's output ids [1, 5, 8].
    assert cfg["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [1, 5, 8],
        "use_aux_hidden_state": True,
    }
    tensors = load_file(str(draft / "model.safetensors"))
    assert set(tensors) == set(draft_tensors())
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["fc.weight"].dtype == torch.bfloat16
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]

    res = cli("validate-draft", str(draft), "--target-config", str(target / "config.json"))
    assert res.exit_code == 0, res.output
    assert "OK" in res.output and "[1, 5, 8]" in res.output and "[2, 6, 9]" in res.output
    res = cli("validate-draft", str(draft), "--target-config", str(target), "--json")
    data = json.loads(res.output)
    assert data["ok"] is True and data["summary"]["draft_vocab_size"] == DRAFT_VOCAB
    assert data["summary"]["parameters"] > 0 and data["summary"]["file_bytes"] > 0


def test_export_records_the_held_out_split_for_eval_draft(tmp_path):
    from regen_service.cli.evaldraft import recorded_split

    step = make_checkpoint(tmp_path / "train")
    state = torch.load(step / "state.pt", weights_only=True)
    torch.save({**state, "train_config": {"eval_fraction": 0.1, "eval_seed": 7}}, step / "state.pt")
    target = make_target(tmp_path / "target")
    res = cli(
        "export", str(tmp_path / "train"), "--out", str(tmp_path / "draft"), "--target-config", str(target)
    )
    assert res.exit_code == 0, res.output
    # eval-draft reads the split from the exported folder as it does from the checkpoint
    assert recorded_split(str(tmp_path / "draft")) == recorded_split(str(tmp_path / "train")) == (0.1, 7)


def test_export_accepts_step_dir_and_checkpoints_dir(tmp_path):
    step = make_checkpoint(tmp_path / "train")
    assert cli("export", str(step), "--out", str(tmp_path / "a")).exit_code == 0
    assert cli("export", str(tmp_path / "train" / "checkpoints"), "--out", str(tmp_path / "b")).exit_code == 0
    res = cli("export", str(step), "--out", str(tmp_path / "a"))
    assert res.exit_code != 0 and "--overwrite" in res.output


def test_export_refuses_bad_checkpoint_and_leaves_nothing(tmp_path):
    tensors = draft_tensors()
    tensors["d2t"] = tensors["d2t"] + VOCAB  # maps outside the target vocabulary
    make_checkpoint(tmp_path / "train", tensors)
    res = cli("export", str(tmp_path / "train"), "--out", str(tmp_path / "draft"))
    assert res.exit_code == 1
    assert "d2t_range" in res.output and "refused" in res.output
    assert not (tmp_path / "draft").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    res = cli("export", str(tmp_path / "train"), "--out", str(tmp_path / "draft"), "--keep-failed")
    kept = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert res.exit_code == 1 and len(kept) == 1 and (kept[0] / "model.safetensors").exists()


def _rewrite(draft: Path, tensors=None, cfg=None) -> None:
    t = load_file(str(draft / "model.safetensors"))
    c = json.loads((draft / "config.json").read_text())
    if tensors:
        tensors(t)
    if cfg:
        cfg(c)
    save_file(t, str(draft / "model.safetensors"))
    (draft / "config.json").write_text(json.dumps(c))


def _rename_layers(t):
    for k in [k for k in t if k.startswith("midlayer.")]:
        t["layers.0." + k.removeprefix("midlayer.")] = t.pop(k)


def _set_aux(ids):
    return lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=ids)


PLANTED = {
    "model_layers9": (
        dict(tensors=lambda t: t.update({"model.layers.9.mlp.up_proj.weight": torch.zeros(INTER, H)})),
        "unknown_keys",
        ["model.layers.9.mlp.up_proj.weight", "SKIP", "num_hidden_layers"],
    ),
    "missing_key": (dict(tensors=lambda t: t.pop("norm.weight")), "missing_key", ["norm.weight"]),
    "architecture": (
        dict(cfg=lambda c: c.update(architectures=["LlamaForCausalLMEagle"])),
        "architecture",
        ["KeyError", "LlamaForCausalLMEagle3"],
    ),
    "fc_width": (
        dict(tensors=lambda t: t.update({"fc.weight": torch.zeros(H, 2 * H)})),
        "fc_width",
        ["fc takes 128 inputs", "3 * 64"],
    ),
    "vocab_size": (dict(cfg=lambda c: c.update(vocab_size=600)), "vocab_size", ["target's is 500"]),
    "d2t_missing": (dict(tensors=lambda t: t.pop("d2t")), "d2t_missing", ["FIRST", "silently"]),
    "d2t_length": (
        dict(tensors=lambda t: t.update(d2t=t["d2t"][:100])),
        "d2t_length",
        ["draft_vocab_size is 128"],
    ),
    "d2t_range": (
        dict(tensors=lambda t: t.update(d2t=t["d2t"] + 450)),
        "d2t_range",
        ["outside the target vocabulary"],
    ),
    "t2d_mismatch": (
        dict(tensors=lambda t: t.update(t2d=torch.roll(t["t2d"], 1))),
        "t2d_mismatch",
        ["t2d[i + d2t[i]]"],
    ),
    "lm_head_rows": (
        dict(tensors=lambda t: t.update({"lm_head.weight": torch.zeros(100, H)})),
        "lm_head_rows",
        ["100 rows", "draft_vocab_size is 128"],
    ),
    "aux_range": (dict(cfg=_set_aux([1, 5, 11])), "aux_range", ["[11]", "0..10", "id+1"]),
    # two ids: both engines build fc for 2 aux states, but the weights were trained on 3
    "aux_count": (dict(cfg=_set_aux([1, 5])), "fc_width", ["2 aux layers", "2 * 64"]),
    "aux_repeat": (dict(cfg=_set_aux([2, 2, 1])), "aux_repeat", ["repeat", "[1, 5, 8]"]),
    "aux_order": (dict(cfg=_set_aux([5, 1, 8])), "aux_order", ["not increasing"]),
    "tied": (dict(cfg=lambda c: c.update(tie_word_embeddings=True)), "tied_embeddings", ["lm_head"]),
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_planted_failure_is_refused(exported, case):
    draft, target = exported
    mutation, code, needles = PLANTED[case]
    _rewrite(draft, **mutation)
    res = cli("validate-draft", str(draft), "--target-config", str(target), "--json")
    assert res.exit_code == 1, res.output
    problems = {p["code"]: p for p in json.loads(res.output)["problems"]}
    assert code in problems, problems
    text = problems[code]["message"] + " " + problems[code]["fix"]
    for needle in needles:
        assert needle in text, (needle, text)
    assert problems[code]["fix"]
    human = cli("validate-draft", str(draft), "--target-config", str(target))
    assert human.exit_code == 1 and f"[{code}]" in human.output and "fix:" in human.output


def test_all_problems_reported_at_once(exported):
    draft, target = exported
    _rewrite(
        draft,
        tensors=lambda t: (t.pop("d2t"), t.pop("norm.weight"), t.update(stray=torch.zeros(2))),
        cfg=lambda c: (c.update(architectures=["Eagle3Speculator"]), _set_aux([1, 5, 40])(c)),
    )
    res = cli("validate-draft", str(draft), "--target-config", str(target), "--json")
    problems = json.loads(res.output)["problems"]
    codes = {p["code"] for p in problems}
    assert {"d2t_missing", "unknown_keys", "architecture", "aux_range", "missing_key"} <= codes
    # every refusal names the file to edit and the key in it
    assert all(p["file"] and p["key"] for p in problems), problems


def test_fc_width_against_another_target(exported, tmp_path):
    draft, _ = exported
    other = make_target(tmp_path / "other", hidden=80)
    res = cli("validate-draft", str(draft), "--target-config", str(other), "--json")
    codes = {p["code"] for p in json.loads(res.output)["problems"]}
    assert res.exit_code == 1 and "fc_width" in codes


def test_validate_draft_real_cli_exit_codes(exported):
    draft, target = exported
    ok = subprocess.run(
        regen_cmd("validate-draft", str(draft), "--target-config", str(target)), capture_output=True
    )
    assert ok.returncode == 0, ok.stderr
    (draft / "config.json").write_text(
        json.dumps({**json.loads((draft / "config.json").read_text()), "architectures": ["LlamaForCausalLM"]})
    )
    bad = subprocess.run(
        regen_cmd("validate-draft", str(draft), "--target-config", str(target)), capture_output=True
    )
    assert bad.returncode == 1 and b"architecture" in bad.stdout


def test_default_aux_layers_are_distinct_for_every_depth():
    from regen_service.draft import sglang_format as fmt

    for n in range(4, 200):
        ids = fmt.default_aux_inputs(n)
        assert fmt.aux_input_problem(ids, n) is None, (n, ids)
        if n >= 8:
            assert ids == [2, n // 2, n - 3]  # both engines' own default wherever it is distinct
    assert fmt.default_aux_inputs(6) == [1, 3, 5]  # [2, 3, 3] would capture two layers for an fc of three


def test_export_for_vllm_writes_input_ids_and_sglang_refuses_it(tmp_path):
    make_checkpoint(tmp_path / "train")
    target = make_target(tmp_path / "target")
    draft = tmp_path / "draft"
    res = cli("export", str(tmp_path / "train"), "--out", str(draft), "--target-config", str(target),
              "--engine", "vllm")  # fmt: skip
    assert res.exit_code == 0, res.output
    cfg = json.loads((draft / "config.json").read_text())
    # vLLM reads the ids as captured layer inputs, unchanged
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 6, 9]
    assert cfg["regen"] == {"engine": "vllm", "aux_layer_inputs": [2, 6, 9]}
    ok = cli("validate-draft", str(draft), "--target-config", str(target), "--engine", "vllm", "--json")
    assert ok.exit_code == 0, ok.output
    bad = cli("validate-draft", str(draft), "--target-config", str(target), "--json")
    problems = {p["code"]: p for p in json.loads(bad.output)["problems"]}
    assert bad.exit_code == 1 and "aux_engine" in problems
    assert "--engine sglang" in problems["aux_engine"]["fix"]


def test_full_vocabulary_draft_carries_no_map_and_vllm_refuses_one(tmp_path):
    t = draft_tensors()
    t["lm_head.weight"] = torch.zeros(VOCAB, H)
    t["d2t"] = torch.zeros(VOCAB, dtype=torch.int64)
    t["t2d"] = torch.ones(VOCAB, dtype=torch.bool)
    step = make_checkpoint(tmp_path / "train", tensors=t)
    state = torch.load(step / "state.pt", weights_only=False)
    state["draft_config"]["draft_vocab_size"] = VOCAB
    torch.save(state, step / "state.pt")
    target = make_target(tmp_path / "target")
    for engine in ("sglang", "vllm"):
        out = tmp_path / f"draft-{engine}"
        res = cli("export", str(tmp_path / "train"), "--out", str(out), "--target-config", str(target),
                  "--engine", engine)  # fmt: skip
        assert res.exit_code == 0, res.output
        assert not {"d2t", "t2d"} & set(load_file(str(out / "model.safetensors")))
    # the same draft with the identity map planted: vLLM fails to load it, so validate-draft refuses it
    out = tmp_path / "draft-vllm"
    weights = load_file(str(out / "model.safetensors"))
    weights.update(d2t=torch.zeros(VOCAB, dtype=torch.int64), t2d=torch.ones(VOCAB, dtype=torch.bool))
    save_file(weights, str(out / "model.safetensors"))
    res = cli("validate-draft", str(out), "--target-config", str(target), "--engine", "vllm", "--json")
    codes = {p["code"] for p in json.loads(res.output)["problems"]}
    assert res.exit_code == 1 and "vocab_map_identity" in codes
