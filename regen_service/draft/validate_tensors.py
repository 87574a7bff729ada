"""Tensor checks of a draft: every name resolves to a parameter the engine loads, every shape matches the
config, the embedding is shipped where the engine will not share the target's, and d2t/t2d map the
draft vocabulary into the target's. Reads the safetensors header and the small d2t/t2d tensors only.

Names are compared the way each loader resolves them (sglang_format.llama_loader_name,
mla_format.loader_name); messages show them as they are written in the file. Config checks are
validate_config.py's.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from regen_service.draft import mla_format as mla
from regen_service.draft import sglang_format as fmt
from regen_service.draft.report import DraftReport

_NP_DTYPES = {"I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}


def resolved_names(header: dict, kind: str, engine: fmt.Engine = "sglang") -> dict[str, str]:
    """Loader name -> name in the file. vLLM 0.32's Llama draft maps only `midlayer.` to `layers.0.` (its
    `hf_to_vllm_mapper`) and prefixes `model.` itself, so it knows neither SGLang's legacy norm names
    nor a `model.` prefix (its loader raises on them)."""
    if kind == "mla":
        resolve = mla.loader_name
    elif engine == "vllm":
        resolve = lambda k: k.replace("midlayer.", "layers.0.")  # noqa: E731
    else:
        resolve = fmt.llama_loader_name
    return {resolve(k): k for k in header}


def shape_tables(cfg: dict, kind: str, t_hidden: int, engine: fmt.Engine) -> tuple[dict, dict]:
    if kind == "mla":
        return mla.expected_shapes(cfg, t_hidden), mla.optional_shapes(cfg)
    return fmt.expected_shapes(cfg, t_hidden, engine), fmt.optional_shapes(cfg, engine)


def check_tensors(
    rep: DraftReport, cfg: dict, header: dict, owner: dict, kind: str, t_hidden: int, engine: fmt.Engine
) -> None:
    names = resolved_names(header, kind, engine)
    if engine == "vllm":
        cfg = {k: v for k, v in cfg.items() if k != "use_aux_norm"}  # vLLM 0.32 reads `fc_norm` only
    required, optional = shape_tables(cfg, kind, t_hidden, engine)
    file_of = lambda name: owner[names[name]].name if name in names else fmt.WEIGHTS_FILE  # noqa: E731
    unknown = sorted(names[n] for n in names if n not in required and n not in optional)
    if unknown:
        shown = ", ".join(unknown[:6]) + (f" and {len(unknown) - 6} more" if len(unknown) > 6 else "")
        how = "logs a warning and skips" if kind == "mla" else "would SKIP without a message"
        prefix = kind == "mla" and any(u.startswith("model.") for u in unknown)
        rep.add(
            "unknown_keys",
            f"{len(unknown)} tensor(s) the engine's loader {how}: {shown}; the draft would run with those "
            "weights random",
            "drop the `model.` prefix: this loader adds its own"
            if prefix
            else "rename them to the loader's names (layers.N.* or midlayer.*, fc, fc_norm.N, norm, lm_head, "
            "d2t, t2d), drop them, or fix the config flag that declares them (fc_norm, norm_before_fc, "
            "num_hidden_layers)",
            file=owner[unknown[0]].name,
            key=unknown[0],
        )
    if "fc.bias" in names and not cfg.get("bias"):
        rep.add(
            "fc_bias_skipped",
            'fc.bias is present but config.json has no `"bias": true`, so the engine builds fc without a bias '
            "and skips it silently",
            'set "bias": true in config.json (or drop fc.bias if it is all zeros)',
            file=file_of("fc.bias"),
            key="fc.bias",
        )
    # A draft over the whole target vocabulary needs no id map: vLLM then builds none and refuses a
    # `d2t` tensor at load (model_executor/models/llama_eagle3.py); SGLang reads an absent map as identity.
    identity = cfg.get("draft_vocab_size") is not None and cfg.get("draft_vocab_size") == cfg.get(
        "vocab_size"
    )
    if identity and engine == "vllm" and ("d2t" in names or "t2d" in names):
        rep.add(
            "vocab_map_identity",
            "draft_vocab_size equals vocab_size, so vLLM builds no draft-to-target map and fails to load "
            "the d2t/t2d tensors this draft carries",
            "drop d2t and t2d (`regen export --engine vllm` does), or train with a smaller draft_vocab_size",
            file=file_of("d2t"),
            key="d2t",
        )
    _check_missing(rep, names, required, identity, kind, engine)
    _check_embedding(rep, cfg, names, file_of, t_hidden)
    for name, want in {**required, **optional}.items():
        if name in names:
            _check_shape(rep, name, names[name], tuple(header[names[name]]["shape"]), want, t_hidden, file_of)
    kv_b = "layers.0.self_attn.kv_b_proj.weight"
    if kind == "mla" and kv_b in names and header[names[kv_b]]["dtype"] not in mla.FLOAT_DTYPES:
        rep.add(
            "kv_b_dtype",
            f"{names[kv_b]} is {header[names[kv_b]]['dtype']}: SGLang splits it into w_kc/w_vc after loading "
            "and raises NotImplementedError for a non-float dtype",
            "store the draft in bfloat16 (`regen export --dtype bfloat16`)",
            file=file_of(kv_b),
            key=names[kv_b],
        )


def _check_missing(
    rep: DraftReport, names: dict, required: dict, identity: bool, kind: str, engine: fmt.Engine
) -> None:
    for key in required:
        if key in names or (identity and key in ("d2t", "t2d")):
            continue
        shown = key.replace("layers.0.", "midlayer.") if kind == "llama" else key
        if key == "d2t":
            rep.add(
                "d2t_missing",
                "d2t is missing: serving then maps draft ids to the FIRST draft_vocab_size target ids, "
                "nearly every draft token is wrong and acceptance collapses, silently",
                "export d2t (int64 offsets, target_id = i + d2t[i]) from the draft vocabulary used in "
                "training; `regen export` writes it from the checkpoint",
                file=fmt.WEIGHTS_FILE,
                key="d2t",
            )
            continue
        fused = kind == "mla" and ("q_a_proj" in key or "kv_a_proj_with_mqa" in key)
        why = " (SGLang fuses q_a_proj with kv_a_proj_with_mqa only when both are present)" if fused else ""
        other = _other_engine_norm(key, engine)
        if other and other in names:
            why = (
                f" ({engine} normalises an extra layer's input with {key.split('.')[-2]}; this draft carries "
                f"{other.split('.')[-2]}, which the other engine uses and {engine} ignores: rename "
                f"{names[other]} to {shown} to serve it with {engine})"
            )
        rep.add(
            "missing_key",
            f"required tensor {shown} is missing: the engine would leave it uninitialized" + why,
            "re-export the draft (`regen export`), or convert it (`regen convert-draft`) if it is a "
            "speculators draft; a config flag (fc_norm, norm_before_fc, num_hidden_layers) may declare "
            "weights the draft was not trained with",
            file=fmt.WEIGHTS_FILE,
            key=shown,
        )


def _other_engine_norm(key: str, engine: fmt.Engine) -> str | None:
    """For an extra layer's pre-attention norm: the name the other engine uses for it."""
    mine = fmt.EXTRA_LAYER_NORM[engine]
    if not key.startswith("layers.") or key.startswith("layers.0.") or not key.endswith(mine):
        return None
    return key[: -len(mine)] + fmt.EXTRA_LAYER_NORM["vllm" if engine == "sglang" else "sglang"]


def _check_embedding(rep: DraftReport, cfg: dict, names: dict, file_of, t_hidden: int) -> None:
    """SGLang's set_embed keeps the draft's own embedding when the config's target_hidden_size differs
    from hidden_size; vLLM 0.32 shares the target's whenever the checkpoint has no embed_tokens. Either
    way a draft narrower or wider than its target must ship the embedding it was trained with."""
    h = cfg.get("hidden_size")
    if h is None or int(h) == t_hidden or "embed_tokens.weight" in names:
        return
    rep.add(
        "embed_missing",
        f"hidden_size is {h} but the target's is {t_hidden}, so the target's embedding cannot be shared "
        "(SGLang's set_embed skips it) and this draft ships no embed_tokens.weight: it would serve with an "
        "uninitialised embedding and accept nothing, silently",
        f"ship embed_tokens.weight [vocab_size, {h}] (the embedding trained with the draft; `regen export` "
        "and `regen convert-draft` keep it when the hidden sizes differ)",
        file=file_of("embed_tokens.weight"),
        key="embed_tokens.weight",
    )


def _check_shape(rep, name: str, raw: str, got: tuple, want: tuple, t_hidden: int, file_of) -> None:
    if got == want:
        return
    file = file_of(name)
    if name == "fc.weight" and len(got) == 2 and got[1] != want[1]:
        n = want[1] // t_hidden
        rep.add(
            "fc_width",
            f"fc takes {got[1]} inputs but the target's hidden size is {t_hidden} and the config names {n} "
            f"aux layers, so the concatenated aux hidden states are {want[1]} wide",
            "train the draft against this target (or point --target-config at the target it was trained "
            f"for); fc.weight must be [hidden_size, {n} * {t_hidden}]",
            file=file,
            key=raw,
        )
    elif name == "lm_head.weight" and len(got) == 2 and got[0] != want[0]:
        rep.add(
            "lm_head_rows",
            f"lm_head has {got[0]} rows but draft_vocab_size is {want[0]}",
            "set draft_vocab_size to the lm_head's row count (the draft vocabulary size used in training)",
            file=file,
            key=raw,
        )
    elif name == "d2t":
        rep.add(
            "d2t_length",
            f"d2t has shape {list(got)} but draft_vocab_size is {want[0]}",
            "export d2t from the same draft vocabulary as lm_head (one offset per draft id)",
            file=file,
            key=raw,
        )
    elif name == "t2d":
        rep.add(
            "t2d_length",
            f"t2d has shape {list(got)} but vocab_size (target vocabulary) is {want[0]}",
            "t2d must be a bool mask over the target vocabulary; re-export it",
            file=file,
            key=raw,
        )
    else:
        rep.add(
            "shape_mismatch",
            f"{raw} has shape {list(got)}, config.json implies {list(want)}",
            "make config.json's dims match the trained weights (regen export derives them from the "
            "checkpoint)",
            file=file,
            key=raw,
        )


def read_small_tensor(path: Path, entry: dict):
    import numpy as np

    dt = _NP_DTYPES.get(entry["dtype"])
    if dt is None:
        return None
    b, e = entry["data_offsets"]
    with open(path, "rb") as f:
        f.seek(entry["data_start"] + b)
        return np.frombuffer(f.read(e - b), dtype=dt).reshape(entry["shape"])


def read_safetensors_header(path: str | Path) -> dict[str, dict]:
    """Tensor name -> {dtype, shape, data_offsets} from the file's JSON header; reads no tensor data,
    needs no torch (validation must run on a CPU box in a second)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise ValueError(f"{path} is not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as e:
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e).splitlines()[0]
            raise ValueError(f"{path} is not a safetensors file (its header is not JSON: {why})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file (its header is a {type(header).__name__})")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        if not _entry_ok(entry):
            raise ValueError(
                f"{path} is not a safetensors file (header entry {name[:80]!r} lacks dtype, shape, data_offsets)"
            )
        entry["data_start"] = 8 + n
    return header


def _entry_ok(entry) -> bool:
    ints = lambda v: isinstance(v, list) and all(type(x) is int and x >= 0 for x in v)  # noqa: E731
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("dtype"), str)
        and ints(entry.get("shape"))
        and ints(entry.get("data_offsets"))
        and len(entry["data_offsets"]) == 2
        and entry["data_offsets"][0] <= entry["data_offsets"][1]
    )
