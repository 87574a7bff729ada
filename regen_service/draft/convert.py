"""Convert a vllm-project/speculators EAGLE-3 draft into SGLang's format, then validate it.

speculators writes `layers.0.*` (SGLang: `midlayer.*`), `architectures: ["Eagle3Speculator"]`, the
decoder dims under `transformer_layer_config`, and aux ids in vLLM's convention (captured layer
INPUTS, default [2, L//2, L-3]). speculators' training defaults (src/speculators/train/config: eagle3
turns on norm_before_residual, norm_before_fc and norm_output) map onto SGLang 0.5.23 as follows:
norm_before_fc (`input_norm.weight`), fc_norm (`fc_norm.N.weight`), norm_output and extra decoder layers
are config flags SGLang's llama_eagle3.py builds, so they are carried over (an extra layer's
input_layernorm becomes its hidden_norm, the norm SGLang applies there); norm_before_residual has no
SGLang counterpart and is refused with the reason (vLLM serves such a draft as it is). The mapping is
documented in docs/draft-checkpoints.md; SGLang's side is in sglang_format.py.
"""

from __future__ import annotations

from pathlib import Path

from regen_service.draft import sglang_format as fmt
from regen_service.draft.export import finalize, prepare_out, write_draft
from regen_service.draft.report import DraftReport
from regen_service.draft.validate import validate_draft
from regen_service.errors import ConfigError

# Where speculators versions (and hand-written configs) put the aux layer ids; vLLM convention.
_AUX_FIELDS = ("eagle_aux_hidden_state_layer_ids", "target_layer_ids", "aux_hidden_state_layer_ids")
# The verifier's copies speculators keeps for training; never loaded by an engine.
_DROPPED = ("verifier_norm.weight", "verifier_lm_head.weight")
# EAGLE-3.1 / gpt-oss flags SGLang 0.5.23 reads from a draft config (llama_eagle3.py), copied when true.
_CARRIED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


def is_speculators_config(cfg: dict) -> bool:
    return (
        cfg.get("speculators_model_type") == "eagle3"
        or "Eagle3Speculator" in (cfg.get("architectures") or [])
        or "transformer_layer_config" in cfg
    )


def _aux_inputs(cfg: dict) -> list[int] | None:
    for where in (cfg, cfg.get("speculators_config") or {}, cfg.get("eagle_config") or {}):
        for field in _AUX_FIELDS:
            if where.get(field) is not None:
                return [int(i) for i in where[field]]
    return None


def convert_config(src_cfg: dict, target: fmt.TargetInfo | None) -> tuple[dict, list[str]]:
    """SGLang config.json from a speculators config; returns (config, notes for the operator)."""
    if not is_speculators_config(src_cfg):
        raise ConfigError(
            "source config.json is not a speculators EAGLE-3 config (no speculators_model_type 'eagle3', "
            "no Eagle3Speculator architecture, no transformer_layer_config)"
        )
    if "norm_before_residual" not in src_cfg:
        # speculators' config class defaults it to false, vLLM 0.32's speculators adapter to true
        # (transformers_utils/configs/speculators/algos.py): the function the draft computes is unknown.
        raise ConfigError(
            "config.json does not say whether the draft was trained with norm_before_residual: speculators' "
            "config class defaults it to false, vLLM 0.32 assumes true. Set it in the source config.json to "
            "what training used (speculators' eagle3 training default is true)"
        )
    if src_cfg.get("norm_before_residual"):
        raise ConfigError(
            "config.json norm_before_residual is true (speculators' eagle3 training default): the first layer "
            "takes hidden_norm(fc output) as its residual, and SGLang 0.5.23's llama_eagle3.py has no such "
            "option (it keeps the un-normalised fc output), so converted it would serve a different function "
            "without an error. Serve this directory with vLLM as it is (--speculative-config "
            '\'{"method": "eagle3", "model": SRC}\'; vLLM 0.32 reads speculators configs and honours '
            "norm_before_residual), or retrain with --no-norm-before-residual for SGLang"
        )
    layer = src_cfg.get("transformer_layer_config") or {}
    if src_cfg.get("fc_norm") and src_cfg.get("norm_before_fc"):
        raise ConfigError(
            "config.json sets both fc_norm and norm_before_fc, which speculators itself refuses"
        )
    notes: list[str] = []
    cfg: dict = {
        "architectures": [fmt.ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        **fmt.DEFAULT_CONFIG_FIELDS,
    }
    cfg.update({k: layer[k] for k in fmt.LAYER_CONFIG_FIELDS if layer.get(k) is not None})
    cfg["num_hidden_layers"] = int(layer.get("num_hidden_layers") or 1)
    for flag in _CARRIED_FLAGS:
        if src_cfg.get(flag):
            cfg[flag] = True
            notes.append(f"{flag}: true carried over (SGLang {fmt.SGLANG_VERSION} builds it)")
    cfg["draft_vocab_size"] = int(src_cfg.get("draft_vocab_size") or cfg.get("vocab_size"))
    cfg["target_hidden_size"] = int(src_cfg.get("target_hidden_size") or cfg.get("hidden_size"))
    cfg["tie_word_embeddings"] = False
    aux = _aux_inputs(src_cfg)
    if aux is None and target is not None:
        aux = fmt.default_aux_inputs(target.num_layers)
        notes.append(f"no aux layer ids in the source: assumed vLLM's default inputs {aux}")
    if aux is not None:
        cfg["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": fmt.aux_inputs_to_config(aux),
            "use_aux_hidden_state": True,
        }
        notes.append(
            f"aux layers: captured inputs {aux} -> SGLang config ids {fmt.aux_inputs_to_config(aux)}"
        )
    else:
        notes.append("no aux layer ids in the source and no --target-config: SGLang will use its default")
    return cfg, notes


def convert_tensors(src: dict, cfg: dict, notes: list[str]) -> dict:
    """Rename speculators tensors to SGLang's names; keep the embedding only where the engine will not share
    the target's; derive d2t/t2d from each other when one is missing."""
    import torch

    out = {}
    own_embedding = not fmt.embedding_shared(cfg)
    for name, t in src.items():
        key = fmt.canonical_key(name)
        if key in _DROPPED:
            continue
        if key == "embed_tokens.weight" and not own_embedding:
            # SGLang replaces it with the target's (set_embed); vLLM would keep a copy that differs
            continue
        if key.startswith("layers.0."):
            key = "midlayer." + key[len("layers.0.") :]  # layer 0's name in every SGLang release
        elif key.startswith("layers.") and key.endswith(".input_layernorm.weight"):
            # speculators' extra layers are plain decoder layers normalising their input with
            # input_layernorm; SGLang 0.5.23's apply hidden_norm there (and ignore input_layernorm)
            key = key[: -len("input_layernorm.weight")] + "hidden_norm.weight"
        if key == "fc.bias":
            if not torch.any(t != 0):
                notes.append("dropped fc.bias (all zeros)")
                continue
            cfg["bias"] = True  # SGLang builds fc with a bias only when the config says so
        out[key] = t
    if "d2t" not in out and "t2d" in out:
        hot = torch.nonzero(out["t2d"].bool(), as_tuple=False).flatten().to(torch.int64)
        out["d2t"] = hot - torch.arange(len(hot), dtype=torch.int64)
        notes.append("derived d2t from t2d")
    if "t2d" not in out and "d2t" in out:
        t2d = torch.zeros(int(cfg["vocab_size"]), dtype=torch.bool)
        hot = out["d2t"].to(torch.int64) + torch.arange(len(out["d2t"]), dtype=torch.int64)
        if int(hot.min()) >= 0 and int(hot.max()) < len(t2d):
            t2d[hot] = True
            out["t2d"] = t2d
            notes.append("derived t2d from d2t")
    if own_embedding:
        notes.append(
            f"kept embed_tokens.weight: hidden_size {cfg['hidden_size']} differs from the target's "
            f"{cfg['target_hidden_size']}, so the engine cannot share the target's embedding"
        )
    if "d2t" not in out and "t2d" not in out and cfg["draft_vocab_size"] == cfg.get("vocab_size"):
        # Full vocabulary draft: the identity map is the right one.
        out["d2t"] = torch.zeros(cfg["draft_vocab_size"], dtype=torch.int64)
        out["t2d"] = torch.ones(cfg["vocab_size"], dtype=torch.bool)
        notes.append("draft vocabulary = target vocabulary: wrote the identity d2t/t2d")
    return out


def convert_draft(
    src: str | Path,
    out: str | Path,
    *,
    target: fmt.TargetInfo | None = None,
    dtype: str = "keep",
    overwrite: bool = False,
    keep_failed: bool = False,
) -> tuple[DraftReport, list[str]]:
    """Convert, validate, and move into place; raises ExportRefused when validation fails."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    src = Path(src)
    cfg_path = src / fmt.CONFIG_FILE
    files = sorted(src.glob("*.safetensors"))
    if not cfg_path.is_file() or not files:
        raise ConfigError(f"{src} must hold config.json and *.safetensors (a speculators draft directory)")
    try:
        cfg, notes = convert_config(fmt.read_config_json(cfg_path, "speculators config"), target)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    except ConfigError as e:
        raise ConfigError(f"{cfg_path}: {e}") from e
    tensors: dict = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise ConfigError(
                f"{f}: not a readable safetensors file ({str(e).splitlines()[0]}); convert-draft reads a "
                "speculators draft's model.safetensors: download or copy it again"
            ) from None
    tensors = convert_tensors(tensors, cfg, notes)
    tmp = prepare_out(Path(out), overwrite)
    write_draft(tmp, tensors, cfg, dtype, metadata={"regen_converted_from": str(src)})
    report = validate_draft(tmp, target)
    finalize(tmp, Path(out).resolve(), report, keep_failed, "conversion")
    report.path = str(out)
    return report, notes
