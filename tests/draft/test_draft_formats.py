"""Today's draft formats, planted good and broken, with validate-draft's verdicts: EAGLE-3.1 (fc_norm,
norm_before_fc, norm_output, aux count from eagle_config), extra draft layers, `layers.0.*` names, the MLA
draft SGLang serves for Kimi-K2.5 (Eagle3DeepseekV2ForCausalLM), and drafts whose hidden size differs
from the target's. Verdicts follow SGLang 0.5.23's and vLLM 0.32's loaders (docs/draft-checkpoints.md)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.draft.test_export_validate import (
    DRAFT_VOCAB,
    HD,
    HEADS,
    INTER,
    KV,
    LAYERS,
    VOCAB,
    H,
    cli,
    draft_tensors,
    layer_config,
    make_checkpoint,
    make_target,
)
from tests.procs import regen_cmd

Q_RANK, KV_RANK, NOPE, ROPE, V = 32, 16, 16, 8, 16


def write(root: Path, tensors: dict, cfg: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def llama_cfg(**over) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        **layer_config(),
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": H,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 8], "use_aux_hidden_state": True},
        **over,
    }


def extra_layer(i: int, norm: str = "hidden_norm") -> dict[str, torch.Tensor]:
    """An extra decoder layer: attends over H (not [embedding; hidden]); its pre-attention norm is named
    `hidden_norm` for SGLang 0.5.23, `input_layernorm` for vLLM 0.32 and speculators."""
    r = lambda *s: torch.randn(*s) * 0.02  # noqa: E731
    pre = f"layers.{i}."
    return {
        pre + "self_attn.q_proj.weight": r(HEADS * HD, H),
        pre + "self_attn.k_proj.weight": r(KV * HD, H),
        pre + "self_attn.v_proj.weight": r(KV * HD, H),
        pre + "self_attn.o_proj.weight": r(H, HEADS * HD),
        pre + "mlp.gate_proj.weight": r(INTER, H),
        pre + "mlp.up_proj.weight": r(INTER, H),
        pre + "mlp.down_proj.weight": r(H, INTER),
        pre + f"{norm}.weight": torch.full((H,), 1.5),
        pre + "post_attention_layernorm.weight": torch.ones(H),
    }


def mla_tensors(
    prefix: str = "layers.0.", hidden: int = H, target_hidden: int = H
) -> dict[str, torch.Tensor]:
    """The MLA draft as lightseekorg/kimi-k2.5-eagle3-mla names it (layers.0.*), small."""
    r = lambda *s: torch.randn(*s) * 0.02  # noqa: E731
    t = {k: v for k, v in draft_tensors().items() if not k.startswith("midlayer.")}
    t["fc.weight"] = r(hidden, 3 * target_hidden)
    t["norm.weight"] = torch.ones(hidden)
    t["lm_head.weight"] = r(DRAFT_VOCAB, hidden)
    a = prefix + "self_attn."
    t.update(
        {
            a + "q_a_proj.weight": r(Q_RANK, 2 * hidden),
            a + "q_a_layernorm.weight": torch.ones(Q_RANK),
            a + "q_b_proj.weight": r(HEADS * (NOPE + ROPE), Q_RANK),
            a + "kv_a_proj_with_mqa.weight": r(KV_RANK + ROPE, 2 * hidden),
            a + "kv_a_layernorm.weight": torch.ones(KV_RANK),
            a + "kv_b_proj.weight": r(HEADS * (NOPE + V), KV_RANK),
            a + "o_proj.weight": r(hidden, HEADS * V),
            prefix + "mlp.gate_proj.weight": r(INTER, hidden),
            prefix + "mlp.up_proj.weight": r(INTER, hidden),
            prefix + "mlp.down_proj.weight": r(hidden, INTER),
            prefix + "input_layernorm.weight": torch.ones(hidden),
            prefix + "hidden_norm.weight": torch.ones(hidden),
            prefix + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    )
    return t


def mla_cfg(**over) -> dict:
    cfg = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "kimi_k2",
        "num_hidden_layers": 1,
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "q_lora_rank": Q_RANK,
        "kv_lora_rank": KV_RANK,
        "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE,
        "v_head_dim": V,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": H,
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 8], "use_aux_hidden_state": True},
    }
    return {**cfg, **over}


def verdict(draft: Path, target: Path, engine: str = "sglang") -> tuple[int, dict]:
    res = cli("validate-draft", str(draft), "--target-config", str(target), "--engine", engine, "--json")
    return res.exit_code, json.loads(res.output)


def _fc_norm(t):
    t.update({f"fc_norm.{i}.weight": torch.ones(H) for i in range(3)})


def _legacy_aux_norms(t):
    t.update({f"aux_norm_{n}.weight": torch.ones(H) for n in ("low", "mid", "high")})


def _layers0(t):
    for k in [k for k in t if k.startswith("midlayer.")]:
        t["layers.0." + k.removeprefix("midlayer.")] = t.pop(k)


# name: (tensor mutation, config overrides, engine, expected error codes; empty = accepted)
LLAMA_CASES = {
    "eagle3_1_fc_norm_norm_output": (_fc_norm, dict(fc_norm=True, norm_output=True), "sglang", set()),
    "eagle3_1_legacy_aux_norm_names": (_legacy_aux_norms, dict(use_aux_norm=True), "sglang", set()),
    # vLLM 0.32 reads neither `use_aux_norm` nor the old names: its loader raises on them
    "eagle3_1_legacy_aux_norm_names_vllm": (
        _legacy_aux_norms,
        dict(use_aux_norm=True),
        "vllm",
        {"unknown_keys"},
    ),
    "eagle3_1_fc_norm_vllm": (_fc_norm, dict(fc_norm=True, norm_output=True), "vllm", set()),
    "eagle3_1_fc_norm_flag_without_weights": (None, dict(fc_norm=True), "sglang", {"missing_key"}),
    "eagle3_1_fc_norm_weights_without_flag": (_fc_norm, {}, "sglang", {"unknown_keys"}),
    "norm_before_fc": (
        lambda t: t.update({"input_norm.weight": torch.ones(3 * H)}),
        dict(norm_before_fc=True),
        "sglang",
        set(),
    ),
    "norm_before_fc_in_eagle_config_without_input_norm": (
        None,
        dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 5, 8], "norm_before_fc": True}),
        "sglang",
        {"missing_key"},
    ),
    "four_aux_layers": (
        lambda t: t.update({"fc.weight": torch.zeros(H, 4 * H)}),
        dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 5, 8], "use_aux_hidden_state": True}),
        "sglang",
        set(),
    ),
    "layers0_names": (_layers0, {}, "sglang", set()),
    "two_layers": (lambda t: t.update(extra_layer(1)), dict(num_hidden_layers=2), "sglang", set()),
    "extra_layer_trained_2h_wide": (
        lambda t: t.update(
            {**extra_layer(1), "layers.1.self_attn.q_proj.weight": torch.zeros(HEADS * HD, 2 * H)}
        ),
        dict(num_hidden_layers=2),
        "sglang",
        {"shape_mismatch"},
    ),
    "extra_layer_weights_config_says_one": (
        lambda t: t.update(extra_layer(1)),
        {},
        "sglang",
        {"unknown_keys"},
    ),
    # the engines differ on an extra layer's pre-attention norm: SGLang hidden_norm, vLLM input_layernorm
    "extra_layer_vllm_style_on_sglang": (
        lambda t: t.update(extra_layer(1, norm="input_layernorm")),
        dict(num_hidden_layers=2),
        "sglang",
        {"missing_key"},
    ),
    "extra_layer_vllm_style_on_vllm": (
        lambda t: t.update(extra_layer(1, norm="input_layernorm")),
        dict(num_hidden_layers=2),
        "vllm",
        set(),
    ),
    "extra_layer_sglang_style_on_vllm": (
        lambda t: t.update(extra_layer(1)),
        dict(num_hidden_layers=2),
        "vllm",
        {"missing_key"},
    ),
    "norm_before_residual_sglang": (
        None,
        dict(norm_before_residual=True),
        "sglang",
        {"norm_before_residual"},
    ),
    "norm_before_residual_vllm": (None, dict(norm_before_residual=True), "vllm", set()),
    "head_dim_16_sglang": (
        lambda t: t.update(
            {
                "midlayer.self_attn.q_proj.weight": torch.zeros(16 * HEADS, 2 * H),
                "midlayer.self_attn.k_proj.weight": torch.zeros(16 * KV, 2 * H),
                "midlayer.self_attn.v_proj.weight": torch.zeros(16 * KV, 2 * H),
                "midlayer.self_attn.o_proj.weight": torch.zeros(H, 16 * HEADS),
            }
        ),
        dict(head_dim=16),
        "sglang",
        {"head_dim"},
    ),
}


@pytest.mark.parametrize("case", sorted(LLAMA_CASES))
def test_llama_style_formats(tmp_path, case):
    mutate, over, engine, codes = LLAMA_CASES[case]
    tensors = draft_tensors()
    if mutate:
        mutate(tensors)
    target = make_target(tmp_path / "target")
    cfg = llama_cfg(**over)
    if engine == "vllm":
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 6, 9]
    draft = write(tmp_path / "draft", tensors, cfg)
    rc, rep = verdict(draft, target, engine)
    errors = {p["code"]: p for p in rep["problems"] if p["severity"] == "error"}
    assert set(errors) == codes, errors
    assert rc == (1 if codes else 0)
    for p in errors.values():  # every refusal names the file, the key and the fix
        assert p["file"] in ("config.json", "model.safetensors") and p["key"] and p["fix"], p
    if case.startswith("extra_layer_") and codes == {"missing_key"}:
        assert "rename layers.1." in errors["missing_key"]["message"], errors
    if not codes:
        assert rep["summary"]["engine_version"] == ("sglang 0.5.23" if engine == "sglang" else "vllm 0.32.0")


def test_eagle3_1_summary_names_the_format_and_sglang_version(tmp_path):
    t = draft_tensors()
    _fc_norm(t)
    t.update(extra_layer(1))
    draft = write(tmp_path / "draft", t, llama_cfg(fc_norm=True, norm_output=True, num_hidden_layers=2))
    res = cli("validate-draft", str(draft), "--target-config", str(make_target(tmp_path / "target")))
    assert res.exit_code == 0, res.output
    assert "eagle3.1 (2 layers)" in res.output and "sglang 0.5.23" in res.output


# Hidden size differs from the target's (draft 64, target 96): SGLang's set_embed does not share the
# target's embedding, vLLM shares it only when the checkpoint has none; the draft must ship its own.
WIDE = 96


def _narrow_draft(**over) -> tuple[dict, dict]:
    t = draft_tensors()
    t["fc.weight"] = torch.zeros(H, 3 * WIDE)
    return t, llama_cfg(target_hidden_size=WIDE, **over)


def test_hidden_size_differs_needs_its_own_embedding(tmp_path):
    target = make_target(tmp_path / "target", hidden=WIDE)
    t, cfg = _narrow_draft()
    rc, rep = verdict(write(tmp_path / "no-embed", t, cfg), target)
    embed = [p for p in rep["problems"] if p["code"] == "embed_missing"]
    assert rc == 1 and embed and embed[0]["key"] == "embed_tokens.weight"
    assert "accept nothing" in embed[0]["message"] and "[vocab_size, 64]" in embed[0]["fix"]
    for engine in ("sglang", "vllm"):
        cfg_e = {**cfg, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 8] if engine == "sglang"
                                         else [2, 6, 9]}}  # fmt: skip
        rc, _ = verdict(write(tmp_path / f"no-embed-{engine}", t, cfg_e), target, engine)
        assert rc == 1
    t["embed_tokens.weight"] = torch.zeros(VOCAB, H)
    rc, rep = verdict(write(tmp_path / "embed", t, cfg), target)
    assert rc == 0, rep
    t["embed_tokens.weight"] = torch.zeros(VOCAB, WIDE)  # the target's width: wrong
    rc, rep = verdict(write(tmp_path / "wide-embed", t, cfg), target)
    assert rc == 1 and "shape_mismatch" in {p["code"] for p in rep["problems"]}
    # no target_hidden_size at all: both engines build fc for 3 x hidden_size
    t2, cfg2 = _narrow_draft()
    cfg2.pop("target_hidden_size")
    rc, rep = verdict(write(tmp_path / "undeclared", t2, cfg2), target)
    assert rc == 1 and "target_hidden_size_missing" in {p["code"] for p in rep["problems"]}


def test_export_keeps_the_embedding_only_when_hidden_sizes_differ(tmp_path):
    t = draft_tensors()
    t["fc.weight"] = torch.zeros(H, 3 * WIDE)
    t["embed_tokens.weight"] = torch.randn(VOCAB, H)
    step = make_checkpoint(tmp_path / "train", tensors=t)
    state = torch.load(step / "state.pt", weights_only=False)
    state["draft_config"]["target_hidden_size"] = WIDE
    torch.save(state, step / "state.pt")
    target = make_target(tmp_path / "target", hidden=WIDE)
    res = cli(
        "export", str(tmp_path / "train"), "--out", str(tmp_path / "draft"), "--target-config", str(target)
    )
    assert res.exit_code == 0, res.output
    assert "embed_tokens.weight" in load_file(str(tmp_path / "draft" / "model.safetensors"))
    # same hidden size: the engines use the target's embedding, export drops the copy
    t2 = draft_tensors()
    t2["embed_tokens.weight"] = torch.randn(VOCAB, H)
    make_checkpoint(tmp_path / "train2", tensors=t2)
    res = cli("export", str(tmp_path / "train2"), "--out", str(tmp_path / "draft2"))
    assert res.exit_code == 0, res.output
    assert "embed_tokens.weight" not in load_file(str(tmp_path / "draft2" / "model.safetensors"))


def _drop(key):
    return lambda t: t.pop(key)


MLA_CASES = {
    "lightseek_layers0_names": (None, {}, "sglang", set()),
    "midlayer_names": ("midlayer", {}, "sglang", set()),
    "eagle3_1_mla": (
        lambda t: t.update({f"fc_norm.{i}.weight": torch.ones(H) for i in range(3)}),
        dict(fc_norm=True, norm_output=True),
        "sglang",
        set(),
    ),
    "kv_a_proj_missing": (
        _drop("layers.0.self_attn.kv_a_proj_with_mqa.weight"),
        {},
        "sglang",
        {"missing_key"},
    ),
    "model_prefix": (
        lambda t: [t.update({"model." + k: t.pop(k)}) for k in [k for k in t if k.startswith("layers.0.")]],
        {},
        "sglang",
        {"unknown_keys", "missing_key"},
    ),
    "q_lora_rank_missing": (None, dict(q_lora_rank=None), "sglang", {"config_fields"}),
    "two_layers": (None, dict(num_hidden_layers=2), "sglang", {"num_layers"}),
    "norm_before_fc_sglang": (
        lambda t: t.update({"input_norm.weight": torch.ones(3 * H)}),
        dict(norm_before_fc=True),
        "sglang",
        {"norm_before_fc"},
    ),
    "norm_before_fc_vllm": (
        lambda t: t.update({"input_norm.weight": torch.ones(3 * H)}),
        dict(norm_before_fc=True),
        "vllm",
        set(),
    ),
    "q_b_proj_wrong_rank": (
        lambda t: t.update(
            {"layers.0.self_attn.q_b_proj.weight": torch.zeros(HEADS * (NOPE + ROPE), 2 * Q_RANK)}
        ),
        {},
        "sglang",
        {"shape_mismatch"},
    ),
    "kv_b_proj_int8": (
        lambda t: t.update(
            {
                "layers.0.self_attn.kv_b_proj.weight": torch.zeros(
                    HEADS * (NOPE + V), KV_RANK, dtype=torch.int8
                )
            }
        ),
        {},
        "sglang",
        {"kv_b_dtype"},
    ),
}


@pytest.mark.parametrize("case", sorted(MLA_CASES))
def test_mla_draft(tmp_path, case):
    mutate, over, engine, codes = MLA_CASES[case]
    tensors = mla_tensors("midlayer." if mutate == "midlayer" else "layers.0.")
    if callable(mutate):
        mutate(tensors)
    cfg = mla_cfg(**over)
    if engine == "vllm":
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 6, 9]
    draft = write(tmp_path / "draft", tensors, cfg)
    rc, rep = verdict(draft, make_target(tmp_path / "target"), engine)
    errors = {p["code"]: p for p in rep["problems"] if p["severity"] == "error"}
    assert set(errors) == codes, errors
    assert rc == (1 if codes else 0)
    for p in errors.values():
        assert p["file"] in ("config.json", "model.safetensors") and p["key"] and p["fix"], p
    if not codes:
        assert rep["summary"]["architecture"] == "Eagle3DeepseekV2ForCausalLM"
        assert rep["summary"]["format"].endswith("-mla")


def test_mla_draft_narrower_than_target_ships_its_embedding(tmp_path):
    target = make_target(tmp_path / "target", hidden=WIDE)
    t = mla_tensors(target_hidden=WIDE)
    cfg = mla_cfg(target_hidden_size=WIDE)
    rc, rep = verdict(write(tmp_path / "a", t, cfg), target)
    assert rc == 1 and {p["code"] for p in rep["problems"]} == {"embed_missing"}
    t["embed_tokens.weight"] = torch.zeros(VOCAB, H)
    assert verdict(write(tmp_path / "b", t, cfg), target)[0] == 0


def test_mla_checkpoint_exports_and_validates_real_subprocess(tmp_path):
    t = {k.replace("layers.0.", "midlayer."): v for k, v in mla_tensors().items()}
    step = make_checkpoint(tmp_path / "train", tensors=t)
    state = torch.load(step / "state.pt", weights_only=False)
    state["draft_config"] = {k: v for k, v in mla_cfg(fc_norm=False).items() if k != "eagle_config"}
    torch.save(state, step / "state.pt")
    target = make_target(tmp_path / "target")
    draft = tmp_path / "draft"
    res = cli("export", str(tmp_path / "train"), "--out", str(draft), "--target-config", str(target))
    assert res.exit_code == 0, res.output
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["model_type"] == "kimi_k2"
    assert cfg["q_lora_rank"] == Q_RANK and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [
        1,
        5,
        8,
    ]
    ok = subprocess.run(regen_cmd("validate-draft", str(draft), "--target-config", str(target)), capture_output=True,
                        text=True)  # fmt: skip
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "Eagle3DeepseekV2ForCausalLM (eagle3-mla) in sglang 0.5.23" in ok.stdout
    weights = load_file(str(draft / "model.safetensors"))
    weights.pop("midlayer.self_attn.q_a_proj.weight")
    save_file(weights, str(draft / "model.safetensors"))
    bad = subprocess.run(regen_cmd("validate-draft", str(draft), "--target-config", str(target)), capture_output=True,
                         text=True)  # fmt: skip
    assert bad.returncode == 1 and "checked against sglang 0.5.23's loaders" in bad.stdout
    assert "[missing_key] model.safetensors: midlayer.self_attn.q_a_proj.weight" in bad.stdout or (
        "[missing_key] model.safetensors: layers.0.self_attn.q_a_proj.weight" in bad.stdout
    ), bad.stdout


def test_launch_forces_eagle3_for_the_mla_draft(tmp_path):
    from regen_service.deploy.launch import LaunchSpec, build_launch
    from regen_service.errors import ConfigError

    draft = write(tmp_path / "draft", mla_tensors(), mla_cfg())
    target = make_target(tmp_path / "target", layers=LAYERS)
    argv = build_launch(LaunchSpec(target=str(target), draft=str(draft))).argv
    assert argv[argv.index("--speculative-algorithm") + 1] == "EAGLE3"
    with pytest.raises(ConfigError, match="Eagle3DeepseekV2ForCausalLM"):
        build_launch(LaunchSpec(target=str(target), draft=str(draft), speculative_algorithm="EAGLE"))
