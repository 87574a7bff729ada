"""convert-draft: a synthetic vllm-project/speculators EAGLE-3 draft becomes one SGLang loads."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.draft.test_export_validate import (
    DRAFT_VOCAB,
    LAYERS,
    VOCAB,
    cli,
    draft_tensors,
    layer_config,
    make_target,
)


def make_speculators_draft(root: Path, *, drop: tuple[str, ...] = (), **cfg_overrides) -> Path:
    """speculators' layout: layers.0.*, embed_tokens, Eagle3Speculator, transformer_layer_config."""
    root.mkdir(parents=True)
    tensors = {}
    for k, v in draft_tensors(seed=1).items():
        tensors[k.replace("midlayer.", "layers.0.")] = v
    tensors["embed_tokens.weight"] = torch.randn(VOCAB, 64)
    for k in drop:
        tensors.pop(k)
    save_file(tensors, str(root / "model.safetensors"))
    cfg = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.1.0",
        "transformer_layer_config": {**layer_config(), "model_type": "llama", "num_hidden_layers": 1},
        "draft_vocab_size": DRAFT_VOCAB,
        "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": [2, LAYERS // 2, LAYERS - 3],
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "target"}},
        **cfg_overrides,
    }
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def test_speculators_draft_is_refused_then_converted(tmp_path):
    src = make_speculators_draft(tmp_path / "spec")
    target = make_target(tmp_path / "target")
    before = cli("validate-draft", str(src), "--target-config", str(target))
    assert before.exit_code == 1
    assert "regen convert-draft" in before.output and "[architecture]" in before.output

    res = cli("convert-draft", str(src), "--out", str(tmp_path / "sglang"), "--target-config", str(target))
    assert res.exit_code == 0, res.output
    assert "[2, 6, 9] -> SGLang config ids [1, 5, 8]" in res.output
    out = tmp_path / "sglang"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 5, 8]
    assert cfg["vocab_size"] == VOCAB and cfg["draft_vocab_size"] == DRAFT_VOCAB
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(draft_tensors())  # midlayer.* names, no embedding
    original = load_file(str(src / "model.safetensors"))
    assert torch.equal(
        tensors["midlayer.self_attn.q_proj.weight"], original["layers.0.self_attn.q_proj.weight"]
    )
    assert cli("validate-draft", str(out), "--target-config", str(target)).exit_code == 0


def test_convert_derives_d2t_from_t2d_and_defaults_aux(tmp_path):
    src = make_speculators_draft(tmp_path / "spec", drop=("d2t",), eagle_aux_hidden_state_layer_ids=None)
    target = make_target(tmp_path / "target")
    res = cli(
        "convert-draft", str(src), "--out", str(tmp_path / "out"), "--target-config", str(target), "--json"
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert "derived d2t from t2d" in data["notes"]
    assert data["summary"]["aux_layer_ids_config"] == [1, 5, 8]
    expected = draft_tensors(seed=1)["d2t"]
    assert torch.equal(load_file(str(tmp_path / "out" / "model.safetensors"))["d2t"], expected)


def test_convert_keeps_nonzero_fc_bias_and_declares_it(tmp_path):
    src = make_speculators_draft(tmp_path / "spec")
    t = load_file(str(src / "model.safetensors"))
    t["fc.bias"] = torch.full((64,), 0.5)
    save_file(t, str(src / "model.safetensors"))
    res = cli(
        "convert-draft",
        str(src),
        "--out",
        str(tmp_path / "out"),
        "--target-config",
        str(make_target(tmp_path / "t")),
    )
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["bias"] is True


def test_convert_refuses_what_sglang_cannot_express(tmp_path):
    src = make_speculators_draft(tmp_path / "spec", norm_before_residual=True)
    res = cli("convert-draft", str(src), "--out", str(tmp_path / "out"))
    assert res.exit_code == 1 and "norm_before_residual" in res.output
    assert not (tmp_path / "out").exists()


def test_convert_validation_failure_leaves_nothing(tmp_path):
    src = make_speculators_draft(tmp_path / "spec", drop=("d2t", "t2d"))
    res = cli(
        "convert-draft",
        str(src),
        "--out",
        str(tmp_path / "out"),
        "--target-config",
        str(make_target(tmp_path / "t")),
    )
    assert res.exit_code == 1 and "d2t_missing" in res.output
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


# speculators' eagle3 training defaults (src/speculators/train/config/resolution.py): norm_before_residual,
# norm_before_fc and norm_output on, fc_norm off.
SPECULATORS_DEFAULTS = dict(norm_before_residual=True, norm_before_fc=True, norm_output=True, fc_norm=False)


def _add(src: Path, **extra: torch.Tensor) -> None:
    t = load_file(str(src / "model.safetensors"))
    t.update(extra)
    save_file(t, str(src / "model.safetensors"))


def test_speculators_current_defaults_are_refused_with_the_reason(tmp_path):
    src = make_speculators_draft(tmp_path / "spec", **SPECULATORS_DEFAULTS)
    _add(src, **{"input_norm.weight": torch.ones(3 * 64)})
    res = cli("convert-draft", str(src), "--out", str(tmp_path / "out"))
    assert res.exit_code == 1
    for needle in (
        "config.json",
        "norm_before_residual",
        "SGLang 0.5.23",
        "vLLM",
        "--no-norm-before-residual",
    ):
        assert needle in res.output, (needle, res.output)
    assert not (tmp_path / "out").exists()


def test_speculators_config_without_norm_before_residual_is_refused(tmp_path):
    src = make_speculators_draft(tmp_path / "spec")
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("norm_before_residual")
    (src / "config.json").write_text(json.dumps(cfg))
    res = cli("convert-draft", str(src), "--out", str(tmp_path / "out"))
    assert res.exit_code == 1 and "does not say" in res.output and "vLLM 0.32 assumes true" in res.output


def test_norm_before_fc_and_norm_output_are_carried_over(tmp_path):
    src = make_speculators_draft(tmp_path / "spec", **{**SPECULATORS_DEFAULTS, "norm_before_residual": False})
    _add(src, **{"input_norm.weight": torch.full((3 * 64,), 2.0)})
    target = make_target(tmp_path / "target")
    res = cli("convert-draft", str(src), "--out", str(tmp_path / "out"), "--target-config", str(target))
    assert res.exit_code == 0, res.output
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["norm_before_fc"] is True and cfg["norm_output"] is True and "fc_norm" not in cfg
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(tensors["input_norm.weight"], torch.full((3 * 64,), 2.0))
    ok = cli("validate-draft", str(tmp_path / "out"), "--target-config", str(target), "--json")
    assert ok.exit_code == 0 and json.loads(ok.output)["summary"]["format"] == "eagle3.1"


def test_fc_norm_and_extra_layers_are_converted(tmp_path):
    from tests.draft.test_draft_formats import extra_layer

    src = make_speculators_draft(tmp_path / "spec", fc_norm=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["transformer_layer_config"]["num_hidden_layers"] = 2
    (src / "config.json").write_text(json.dumps(cfg))
    # speculators' extra layers are plain decoder layers: input_layernorm before attention, no hidden_norm
    _add(
        src, **{f"fc_norm.{i}.weight": torch.ones(64) for i in range(3)}, **extra_layer(1, "input_layernorm")
    )
    target = make_target(tmp_path / "target")
    res = cli("convert-draft", str(src), "--out", str(tmp_path / "out"), "--target-config", str(target))
    assert res.exit_code == 0, res.output
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out["fc_norm"] is True and out["num_hidden_layers"] == 2
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "layers.1.self_attn.q_proj.weight" in tensors and "fc_norm.2.weight" in tensors
    # SGLang 0.5.23 normalises an extra layer's input with hidden_norm: the trained weight goes there
    assert torch.equal(tensors["layers.1.hidden_norm.weight"], torch.full((64,), 1.5))
    assert "layers.1.input_layernorm.weight" not in tensors


def test_convert_keeps_the_embedding_when_hidden_sizes_differ(tmp_path):
    src = make_speculators_draft(tmp_path / "spec", target_hidden_size=96)
    _add(src, **{"fc.weight": torch.zeros(64, 3 * 96)})
    target = make_target(tmp_path / "target", hidden=96)
    res = cli("convert-draft", str(src), "--out", str(tmp_path / "out"), "--target-config", str(target))
    assert res.exit_code == 0, res.output
    assert "kept embed_tokens.weight" in res.output
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert tensors["embed_tokens.weight"].shape == (VOCAB, 64)
