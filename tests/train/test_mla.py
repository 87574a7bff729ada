"""The MLA draft (draft_arch "mla"): its attention is DeepSeek-V3's, its flex path equals the eager one,
its shapes come from the target, and what it exports is the checkpoint SGLang's Eagle3DeepseekV2ForCausalLM loads.

The attention is checked against transformers' own DeepseekV3Attention (interleaved rotary, YaRN past
the original context, mscale in the softmax scale), an implementation regen shares no code with. That it decodes as it trains is test_units' check, run for
both architectures.
"""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from regen_service.cli import main
from regen_service.draft.config import DraftConfig
from regen_service.train.config import TrainConfig
from regen_service.train.model import Eagle3Draft
from regen_service.train.trainer import draft_config_for
from regen_service.train.ttt import ttt_loss
from regen_service.train.vocab import build_vocab
from tests.draft.test_export_validate import make_target

H, HEADS, NOPE, ROPE, V, Q_RANK, KV_RANK = 32, 4, 8, 4, 8, 24, 16
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 0.7, "mscale_all_dim": 1.0}  # fmt: skip


def mla_config(rope_scaling: dict | None = None, **kw) -> DraftConfig:
    base = dict(
        hidden_size=H, intermediate_size=64, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        head_dim=NOPE + ROPE, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
        vocab_size=50, draft_vocab_size=12, target_hidden_size=H, rope_scaling=rope_scaling, draft_arch="mla",
        q_lora_rank=Q_RANK, kv_lora_rank=KV_RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V,
    )  # fmt: skip
    return DraftConfig(**{**base, **kw})


@pytest.mark.parametrize("scaling", [None, YARN], ids=["rope", "yarn"])
def test_mla_attention_equals_transformers_deepseek_v3(scaling):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    torch.manual_seed(0)
    draft = Eagle3Draft(mla_config(scaling)).eval()
    ours = draft.midlayer.self_attn
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.2)
    # transformers' layer takes and returns its hidden size: 2H in, and our H-row o_proj padded to 2H out
    rope = (
        {"rope_type": "default", "rope_theta": 10000.0}
        if scaling is None
        else {**scaling, "rope_theta": 10000.0}
    )
    hf_cfg = DeepseekV3Config(
        hidden_size=2 * H, num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=Q_RANK,
        kv_lora_rank=KV_RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V, rope_interleave=True,
        rope_parameters=rope, max_position_embeddings=256, attention_bias=False,
    )  # fmt: skip
    hf_cfg._attn_implementation = "eager"
    ref = DeepseekV3Attention(hf_cfg, 0).eval()
    sd = {k: v for k, v in ours.state_dict().items() if k != "o_proj.weight"}
    sd["o_proj.weight"] = torch.cat([ours.o_proj.weight, torch.zeros(H, HEADS * V)])
    ref.load_state_dict(sd)
    t = 40  # past YaRN's original 32 positions
    x = torch.randn(2, t, 2 * H)
    pos = torch.arange(100, 100 + t)[None].expand(2, -1)
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None].expand(2, 1, t, t)
    with torch.no_grad():
        cos, sin = draft.rotary.at(pos, torch.float32)
        got = ours(x, cos, sin, [])
        want, _ = ref(x, DeepseekV3RotaryEmbedding(hf_cfg)(x, pos), causal)
    assert torch.allclose(got, want[..., :H], atol=2e-5), (got - want[..., :H]).abs().max()


def test_mla_flex_forward_matches_eager_on_cpu():
    torch.manual_seed(0)
    draft = Eagle3Draft(mla_config(YARN)).eval()
    draft.set_vocab(*build_vocab(torch.arange(50), 12))
    aux, ids = torch.randn(2, 128, 3 * H), torch.randint(0, 50, (2, 128))
    with torch.no_grad():
        want, _ = ttt_loss(draft, aux, ids, ids, torch.ones_like(ids), ttt_length=3)
        draft.set_attention("flex")
        with (
            warnings.catch_warnings()
        ):  # uncompiled flex on the CPU warns (once per process) that it is unfused
            warnings.simplefilter("ignore", UserWarning)
            got, _ = ttt_loss(draft, aux, ids, ids, torch.ones_like(ids), ttt_length=3)
    assert torch.allclose(got, want, atol=1e-5)


def _target(**kw) -> SimpleNamespace:
    base = dict(hidden_size=7168, num_attention_heads=64, intermediate_size=18432, vocab_size=163840,
                rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=262144, rope_scaling=None)  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def test_mla_shapes_are_the_mla_targets_own_and_proportional_for_others():
    kimi = _target(
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
    )
    dc = draft_config_for(kimi, TrainConfig(draft_arch="mla").model)
    assert (dc.draft_arch, dc.num_attention_heads, dc.q_lora_rank, dc.kv_lora_rank) == ("mla", 64, 1536, 512)
    assert (dc.qk_nope_head_dim, dc.qk_rope_head_dim, dc.v_head_dim, dc.hidden_size) == (128, 64, 128, 7168)
    # a Llama target (no MLA dims): DeepSeek-V2's proportions of its head dim (4096 / 32 = 128)
    llama = draft_config_for(
        _target(hidden_size=4096, num_attention_heads=32), TrainConfig(draft_arch="mla").model
    )
    assert (llama.q_lora_rank, llama.kv_lora_rank, llama.qk_nope_head_dim, llama.qk_rope_head_dim) == (
        1536,
        512,
        128,
        64,
    )
    assert draft_config_for(kimi, TrainConfig().model).draft_arch == "llama"  # the default stays Llama-style


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_trained_mla_draft_exports_as_sglangs_mla_checkpoint_and_validates(tmp_path, engine):
    torch.manual_seed(0)
    dc = mla_config(YARN, vocab_size=500, draft_vocab_size=128)
    draft = Eagle3Draft(dc)
    draft.set_vocab(*build_vocab(torch.arange(500), 128))
    step = tmp_path / "train" / "checkpoints" / "step-00000007"
    step.mkdir(parents=True)
    torch.save(
        {"draft_state_dict": draft.draft_state_dict(), "draft_config": dc.to_dict(), "aux_layer_ids": [2, 6, 9],
         "target_num_layers": 12, "optimizer": {}, "step": 7, "shards": []},
        step / "state.pt",
    )  # fmt: skip
    (tmp_path / "train" / "checkpoints" / "latest").write_text(step.name + "\n")
    target = make_target(tmp_path / "target", hidden=H, layers=12, vocab=500)
    out = tmp_path / "draft"
    run = CliRunner().invoke(main, ["export", str(tmp_path / "train"), "--out", str(out), "--target-config",
                                    str(target), "--engine", engine], catch_exceptions=False)  # fmt: skip
    assert run.exit_code == 0, run.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["num_hidden_layers"] == 1
    assert (cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (Q_RANK, KV_RANK, ROPE)
    assert cfg["rope_scaling"]["mscale_all_dim"] == 1.0  # the softmax scale the draft trained with
    check = CliRunner().invoke(main, ["validate-draft", str(out), "--target-config", str(target), "--engine",
                                      engine], catch_exceptions=False)  # fmt: skip
    assert check.exit_code == 0, check.output
    assert "eagle3-mla" in check.output
