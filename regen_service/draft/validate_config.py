"""config.json checks of a draft: the architecture the engine builds from it and the config flags it
honours or ignores. Tensor names and shapes are validate_tensors.py's, aux layers and the report
validate.py's.

What each architecture and flag does comes from the loaders of the pinned engines (SGLang 0.5.23:
srt/models/llama_eagle3.py, kimi_k25_eagle3.py; vLLM 0.32: model_executor/models/llama_eagle3.py,
deepseek_eagle3.py, registry.py); docs/draft-checkpoints.md cites them per row.
"""

from __future__ import annotations

from regen_service.draft import mla_format as mla
from regen_service.draft import sglang_format as fmt
from regen_service.draft.report import DraftReport

CFG = fmt.CONFIG_FILE
# What each engine builds an EAGLE-3 draft from (vLLM 0.32 registry.py maps all four; SGLang 0.5.23 has
# one EntryClass per file).
KNOWN_ARCHITECTURES = {
    "sglang": (fmt.ARCHITECTURE, mla.ARCHITECTURE),
    "vllm": (fmt.ARCHITECTURE, "Eagle3LlamaForCausalLM", mla.ARCHITECTURE, *mla.VLLM_ALIASES),
}
_CONVERT_HINT = (
    "this is a vllm-project/speculators config; run `regen convert-draft SRC --out DIR` to rewrite it in "
    "SGLang's format (vLLM serves the speculators directory as it is)"
)


def draft_kind(cfg: dict) -> str:
    """'mla' for the MLA draft, else 'llama' (also for an unknown architecture: its problems are then
    reported against the Llama layout, the one a fix most likely targets)."""
    return "mla" if mla.is_mla(cfg) else "llama"


def format_name(cfg: dict, kind: str) -> str:
    """eagle3 / eagle3.1 (fc_norm or norm_output) / +N layers, and -mla for the MLA draft."""
    name = "eagle3.1" if fmt.fc_norm_enabled(cfg) or cfg.get("norm_output") else "eagle3"
    if kind == "mla":
        name += "-mla"
    layers = int(cfg.get("num_hidden_layers") or 1)
    return name + (f" ({layers} layers)" if layers > 1 else "")


def required_fields(cfg: dict) -> tuple[str, ...]:
    return mla.REQUIRED_CONFIG_FIELDS if draft_kind(cfg) == "mla" else fmt.REQUIRED_CONFIG_FIELDS


def check_config(rep: DraftReport, cfg: dict, target: fmt.TargetInfo | None, engine: fmt.Engine) -> None:
    kind = draft_kind(cfg)
    archs = cfg.get("architectures") or []
    if not archs or archs[0] not in KNOWN_ARCHITECTURES[engine]:
        speculators = "Eagle3Speculator" in archs or "speculators_model_type" in cfg
        rep.add(
            "architecture",
            f"architectures is {archs!r}: {engine} picks the model class from it and has no EAGLE-3 draft of "
            f"that name; SGLang builds a different model and fails at load with KeyError "
            "'midlayer.self_attn.qkv_proj.weight' (an EAGLE-1 class runs a draft that ignores the aux states)",
            _CONVERT_HINT
            if speculators
            else f'set "architectures": ["{fmt.ARCHITECTURE}"] (Llama-style) or ["{mla.ARCHITECTURE}"] (MLA)',
            file=CFG,
            key="architectures",
        )
    missing = [k for k in required_fields(cfg) if cfg.get(k) is None]
    if missing:
        why = " (the MLA layer raises without q_lora_rank)" if "q_lora_rank" in missing else ""
        rep.add(
            "config_fields",
            f"config.json lacks {', '.join(missing)}{why}",
            "add them from the training config (regen export writes every field the engine reads)",
            file=CFG,
            key=", ".join(missing),
        )
    layers = int(cfg.get("num_hidden_layers") or 1)
    if kind == "mla" and layers != 1 and engine == "sglang":
        rep.add(
            "num_layers",
            f"num_hidden_layers is {layers}: SGLang's {mla.ARCHITECTURE} raises 'EAGLE3 currently only "
            "supports 1 layer'",
            'set "num_hidden_layers": 1 (an MLA EAGLE-3 draft has one decoder layer)',
            file=CFG,
            key="num_hidden_layers",
        )
    if cfg.get("tie_word_embeddings"):
        rep.add(
            "tied_embeddings",
            "tie_word_embeddings is true: the engine then uses the (target's) embedding as lm_head over the "
            "full vocabulary and ignores lm_head.weight",
            'set "tie_word_embeddings": false',
            file=CFG,
            key="tie_word_embeddings",
        )
    _check_norm_flags(rep, cfg, kind, engine)
    _check_target(rep, cfg, target)
    if kind == "llama" and engine == "sglang" and not missing:
        hd = fmt.head_dim(cfg)
        if hd not in fmt.FLASHINFER_HEAD_DIMS:
            rep.add(
                "head_dim",
                f"head dim is {hd}: SGLang's FlashInfer attention kernels are built for head dims "
                f"{list(fmt.FLASHINFER_HEAD_DIMS)} only; the draft fails to serve (sglang issue #8126)",
                "train the draft with num_attention_heads / head_dim giving 64, 128 or 256 (128 as the "
                'published Kimi-K2.5 drafts) and write "head_dim" into config.json',
                file=CFG,
                key="head_dim",
            )


def _check_norm_flags(rep: DraftReport, cfg: dict, kind: str, engine: fmt.Engine) -> None:
    if engine != "sglang":
        return  # vLLM 0.32 builds every flag below (llama_eagle3.py, deepseek_eagle3.py)
    if cfg.get("norm_before_residual"):
        rep.add(
            "norm_before_residual",
            "norm_before_residual is true, but SGLang 0.5.23 has no such option: its first draft layer keeps "
            "the un-normalised fc output as the residual, a different function than the one trained, and "
            "loads it without a message",
            "serve this draft with vLLM (`regen launch-vllm`; vLLM 0.32 honours norm_before_residual), or "
            "retrain with norm_before_residual=false (speculators: --no-norm-before-residual)",
            file=CFG,
            key="norm_before_residual",
        )
    if kind == "mla" and fmt.norm_before_fc_enabled(cfg):
        rep.add(
            "norm_before_fc",
            f"norm_before_fc is set, but SGLang 0.5.23's {mla.ARCHITECTURE} builds no input_norm: it skips "
            "input_norm.weight (a log warning only) and fc sees un-normalised aux states",
            "serve it with vLLM (deepseek_eagle3.py honours norm_before_fc), or retrain with fc_norm (EAGLE-3.1's "
            "per-layer norm, which SGLang's MLA draft builds) instead of norm_before_fc",
            file=CFG,
            key="norm_before_fc",
        )


def _check_target(rep: DraftReport, cfg: dict, target: fmt.TargetInfo | None) -> None:
    if target is None:
        return
    if cfg.get("vocab_size") is not None and int(cfg["vocab_size"]) != target.vocab_size:
        rep.add(
            "vocab_size",
            f"vocab_size is {cfg['vocab_size']} but the target's is {target.vocab_size}: the engine sizes "
            "the embedding and the t2d map from it",
            f'set "vocab_size": {target.vocab_size} (the target\'s, not the draft vocabulary)',
            file=CFG,
            key="vocab_size",
        )
    declared = cfg.get("target_hidden_size")
    if declared is not None and int(declared) != target.hidden_size:
        rep.add(
            "target_hidden_size",
            f"target_hidden_size is {declared} but the target's hidden size is {target.hidden_size}",
            "this draft was trained for another target; train one against this target",
            file=CFG,
            key="target_hidden_size",
        )
    elif declared is None and cfg.get("hidden_size") not in (None, target.hidden_size):
        rep.add(
            "target_hidden_size_missing",
            f"hidden_size is {cfg['hidden_size']} but the target's is {target.hidden_size}, and config.json "
            "has no target_hidden_size: both engines then build fc for 3 x hidden_size inputs and SGLang "
            "shares the target's embedding, which is the wrong width",
            f'set "target_hidden_size": {target.hidden_size} and ship the draft\'s own embed_tokens.weight',
            file=CFG,
            key="target_hidden_size",
        )
