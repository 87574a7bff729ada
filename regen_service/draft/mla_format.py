"""What SGLang's MLA EAGLE-3 draft, `Eagle3DeepseekV2ForCausalLM`, loads: names, shapes, config fields.

SGLang serves this architecture for Kimi-K2.x (`srt/models/kimi_k25_eagle3.py`, added by sglang PR
#24826; read in the sglang 0.5.23 wheel): EAGLE-3's layout (fc over the concatenated aux states, one
decoder layer attending over [input_layernorm(embedding); hidden_norm(fc output)], dense MLP, norm,
lm_head over the draft vocabulary) with DeepSeek-V2 multi-latent attention instead of Llama attention,
so the draft's KV cache has the target's MLA shape. vLLM 0.32 loads the same checkpoint
(`model_executor/models/deepseek_eagle3.py`). Facts for validation and export; the Llama-style draft
is in sglang_format.py, the checks in validate*.py.

How SGLang 0.5.23's `load_weights` resolves a name: `d2t`/`t2d` first; then `^layers\\.0\\.` becomes
`midlayer.` and every name but `lm_head.*` gets a `model.` prefix (so a name that already has one is
NOT found); `q_a_proj` and `kv_a_proj_with_mqa` are held until both arrived and then concatenated into
the fused `fused_qkv_a_proj_with_mqa` (one missing: the fused weight stays uninitialised, silently); an
unknown name is skipped with only a log warning. `post_load_weights` splits `kv_b_proj` and raises for
a non-float dtype.
"""

from __future__ import annotations

from regen_service.draft import sglang_format as fmt

ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
# vLLM 0.32's registry maps both names to deepseek_eagle3.Eagle3DeepseekV2ForCausalLM; SGLang knows V2 only.
VLLM_ALIASES = ("Eagle3DeepseekV3ForCausalLM",)

# The MLA attention's own config fields (DeepseekV2AttentionMLA); q_lora_rank must be set (the
# draft layer raises "Eagle3 MLA layer requires q_lora_rank in the draft config" otherwise).
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
REQUIRED_CONFIG_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    *MLA_FIELDS,
    "rms_norm_eps",
    "vocab_size",
    "draft_vocab_size",
)
# Copied from the trainer's draft_config into config.json by export.
CONFIG_FIELDS = (
    *REQUIRED_CONFIG_FIELDS,
    "hidden_act",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
    "target_hidden_size",
)
# kv_b_proj is split into w_kc / w_vc after loading, which only handles these dtypes.
FLOAT_DTYPES = ("BF16", "F16", "F32")


def loader_name(name: str) -> str:
    """The canonical name (`layers.0.*` for the decoder layer, as the Llama check uses) of a tensor SGLang
    0.5.23 finds; a `model.`-prefixed name stays as it is, and is then unknown (the loader adds a
    second prefix and skips it)."""
    if name.startswith("midlayer."):
        return "layers.0." + name[len("midlayer.") :]
    return name


def expected_shapes(cfg: dict, target_hidden: int) -> dict[str, tuple[int, ...]]:
    """Every required weight of the MLA draft, as SGLang 0.5.23 allocates it."""
    h = int(cfg["hidden_size"])
    inter = int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    q_rank, kv_rank = int(cfg["q_lora_rank"]), int(cfg["kv_lora_rank"])
    nope, rope, v = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
    pre = "layers.0."
    shapes: dict[str, tuple[int, ...]] = {
        # the fused down projection takes [embedding; hidden], 2H wide
        pre + "self_attn.q_a_proj.weight": (q_rank, 2 * h),
        pre + "self_attn.kv_a_proj_with_mqa.weight": (kv_rank + rope, 2 * h),
        pre + "self_attn.q_a_layernorm.weight": (q_rank,),
        pre + "self_attn.q_b_proj.weight": (heads * (nope + rope), q_rank),
        pre + "self_attn.kv_a_layernorm.weight": (kv_rank,),
        pre + "self_attn.kv_b_proj.weight": (heads * (nope + v), kv_rank),
        pre + "self_attn.o_proj.weight": (h, heads * v),
        pre + "mlp.gate_proj.weight": (inter, h),
        pre + "mlp.up_proj.weight": (inter, h),
        pre + "mlp.down_proj.weight": (h, inter),
        pre + "input_layernorm.weight": (h,),
        pre + "hidden_norm.weight": (h,),
        pre + "post_attention_layernorm.weight": (h,),
    }
    shapes.update(fmt.aux_shapes(cfg, target_hidden, h, fmt.num_aux(cfg)))
    shapes.update(fmt.head_shapes(cfg, h))
    return shapes


def optional_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h = int(cfg["hidden_size"])
    return {"embed_tokens.weight": (int(cfg["vocab_size"]), h), "fc.bias": (h,)}


def is_mla(cfg: dict) -> bool:
    archs = cfg.get("architectures") or []
    return bool(archs) and archs[0] in (ARCHITECTURE, *VLLM_ALIASES)


def build_config(draft_config: dict) -> dict:
    """config.json for an MLA draft from the trainer's draft_config (aux ids and the engine record are
    added by export.build_config, as for the Llama draft)."""
    cfg: dict = {
        "architectures": [ARCHITECTURE],
        # SGLang 0.5.23 registers a `kimi_k2` config alias of DeepseekV3Config for these drafts
        # (srt/utils/hf_transformers/common.py); vLLM reads the fields it needs by name.
        "model_type": "kimi_k2",
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    }
    for key in CONFIG_FIELDS:
        if draft_config.get(key) is not None:
            cfg[key] = draft_config[key]
    for key in ("fc_norm", "norm_output"):
        if draft_config.get(key):
            cfg[key] = True
    return cfg
