"""What SGLang's `LlamaForCausalLMEagle3` loads: key names, shapes, config fields, aux-layer conventions.

The single source of truth for export, validation, conversion and the launch preflight. Facts come
from SGLang's `srt/models/llama_eagle3.py` as released in sglang 0.5.23 (the `serve` extra's pin; see
docs/draft-checkpoints.md): its loader renames `midlayer` to `layers.0` (and `aux_norm_{low,mid,high}`
to `fc_norm.{0,1,2}`), tries each name as is and with a `model.` prefix, and SKIPS names it does not
know without a message, so every name we write or accept must be one of these. The MLA draft
architecture lives in mla_format.py; reading checkpoints is left to validate*.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

ARCHITECTURE = "LlamaForCausalLMEagle3"
# The SGLang release whose loaders the validator follows (llama_eagle3.py, kimi_k25_eagle3.py, llama.py
# set_embed, speculative/eagle_worker_v2.py), and the vLLM release engine="vllm" follows.
SGLANG_VERSION = "0.5.23"
VLLM_VERSION = "0.32.0"
# FlashInfer's prefill/decode kernels are built for these head dims only (sm90: flashinfer PR #751);
# a Llama-style draft with another head dim fails to serve on SGLang (sglang issue #8126).
FLASHINFER_HEAD_DIMS = (64, 128, 256)
SPEC_ALGORITHM = "EAGLE3"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

# Old names SGLang 0.5.23's llama_eagle3.py `load_weights` renames before loading (`legacy_name_map`).
LEGACY_NAMES = {
    "midlayer": "layers.0",
    "aux_norm_low": "fc_norm.0",
    "aux_norm_mid": "fc_norm.1",
    "aux_norm_high": "fc_norm.2",
}

# The decoder layer's own config fields, copied into config.json by export and convert alike.
LAYER_CONFIG_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "vocab_size",
    "hidden_act",
)

REQUIRED_CONFIG_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "vocab_size",
    "draft_vocab_size",
)
# Llama fields SGLang reads with these defaults when absent; export always writes them.
DEFAULT_CONFIG_FIELDS: dict[str, Any] = {
    "hidden_act": "silu",
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "attention_bias": False,
}


def canonical_key(name: str) -> str:
    """SGLang also accepts every parameter with a `model.` prefix; compare names without it."""
    return name[len("model.") :] if name.startswith("model.") else name


def llama_loader_name(name: str) -> str:
    """The name SGLang 0.5.23's LlamaForCausalLMEagle3 looks a tensor up by: legacy names renamed (a plain
    substring replace, as its loader does), the optional `model.` prefix dropped."""
    for legacy, new in LEGACY_NAMES.items():
        if legacy in name:
            name = name.replace(legacy, new)
    return canonical_key(name)


def num_aux(cfg: dict) -> int:
    """How many aux hidden states fc fuses: SGLang 0.5.23 and vLLM 0.32 both take the length of
    eagle_config.eagle_aux_hidden_state_layer_ids (`num_aux_hidden_states` first), else 3."""
    if cfg.get("num_aux_hidden_states"):
        return int(cfg["num_aux_hidden_states"])
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return len(ids) if ids else 3


def fc_norm_enabled(cfg: dict) -> bool:
    """EAGLE-3.1's per-aux RMSNorm before fc (`fc_norm`, or the older `use_aux_norm`)."""
    return bool(cfg.get("fc_norm") or cfg.get("use_aux_norm"))


def norm_before_fc_enabled(cfg: dict) -> bool:
    """One RMSNorm over the concatenated aux states (`input_norm`); eagle_config's flag wins, as in both
    engines' loaders."""
    return bool((cfg.get("eagle_config") or {}).get("norm_before_fc", cfg.get("norm_before_fc", False)))


def config_target_hidden(cfg: dict) -> int:
    """The target hidden size the ENGINE builds fc for: the config's target_hidden_size, else hidden_size."""
    return int(cfg.get("target_hidden_size") or cfg["hidden_size"])


def embedding_shared(cfg: dict) -> bool:
    """Whether SGLang replaces the draft's embedding with the target's: `set_embed` (srt/models/llama.py and
    kimi_k25_eagle3.py) returns without sharing when the config's target_hidden_size differs from its
    hidden_size, leaving the draft's own (loaded, or uninitialised) embedding."""
    return cfg.get("target_hidden_size") in (None, cfg.get("hidden_size"))


def head_dim(cfg: dict) -> int:
    """SGLang's Llama attention: `head_dim` when the config has it, else hidden_size // heads."""
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    return int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])


def expected_shapes(cfg: dict, target_hidden: int, engine: str = "sglang") -> dict[str, tuple[int, ...]]:
    """Shape of every required weight for a draft config, as the engine allocates it, by the names its
    loader resolves (`layers.N.*`; `midlayer.*` is the same layer 0). Layer 0 attends over
    [embedding; hidden] (2H wide), extra layers (num_hidden_layers > 1) over H. The extra layers'
    pre-attention norm is the one place the engines differ: SGLang 0.5.23 applies `hidden_norm` there,
    vLLM 0.32 (and speculators' training) `input_layernorm`; the other one is unused."""
    h = int(cfg["hidden_size"])
    inter = int(cfg["intermediate_size"])
    hd = head_dim(cfg)
    q = int(cfg["num_attention_heads"]) * hd
    kv = int(cfg["num_key_value_heads"]) * hd
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(int(cfg.get("num_hidden_layers") or 1)):
        width = 2 * h if i == 0 else h
        pre = f"layers.{i}."
        shapes.update(
            {
                pre + "self_attn.q_proj.weight": (q, width),
                pre + "self_attn.k_proj.weight": (kv, width),
                pre + "self_attn.v_proj.weight": (kv, width),
                pre + "self_attn.o_proj.weight": (h, q),
                pre + "mlp.gate_proj.weight": (inter, h),
                pre + "mlp.up_proj.weight": (inter, h),
                pre + "mlp.down_proj.weight": (h, inter),
                pre + "post_attention_layernorm.weight": (h,),
            }
        )
        if i == 0:
            shapes.update({pre + "hidden_norm.weight": (h,), pre + "input_layernorm.weight": (h,)})
        else:
            shapes[pre + EXTRA_LAYER_NORM[engine]] = (h,)
    shapes.update(aux_shapes(cfg, target_hidden, h, num_aux(cfg)))
    shapes.update(head_shapes(cfg, h))
    return shapes


def head_shapes(cfg: dict, h: int) -> dict[str, tuple[int, ...]]:
    """The final norm, lm_head over the draft vocabulary and the vocab maps: the same in every format."""
    return {
        "norm.weight": (h,),
        "lm_head.weight": (int(cfg["draft_vocab_size"]), h),
        "d2t": (int(cfg["draft_vocab_size"]),),
        "t2d": (int(cfg["vocab_size"]),),
    }


# The norm an extra draft layer applies before attention, per engine (SGLang 0.5.23 llama_eagle3.py
# `LlamaDecoderLayer.forward`: `self.hidden_norm(hidden_states, residual)`; vLLM 0.32 llama_eagle3.py:
# `self.input_layernorm(hidden_states, residual)`).
EXTRA_LAYER_NORM = {"sglang": "hidden_norm.weight", "vllm": "input_layernorm.weight"}


def aux_shapes(cfg: dict, target_hidden: int, h: int, n_aux: int) -> dict[str, tuple[int, ...]]:
    """fc and the norms before it, common to the Llama and MLA drafts."""
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (h, n_aux * target_hidden)}
    if fc_norm_enabled(cfg):
        shapes.update({f"fc_norm.{i}.weight": (target_hidden,) for i in range(n_aux)})
    if norm_before_fc_enabled(cfg):
        shapes["input_norm.weight"] = (n_aux * target_hidden,)
    return shapes


def optional_shapes(cfg: dict, engine: str = "sglang") -> dict[str, tuple[int, ...]]:
    """Loaded when present: the draft's own embedding, fc.bias, the extra layers' unused norm."""
    h = int(cfg["hidden_size"])
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (int(cfg["vocab_size"]), h),
        "fc.bias": (h,),
    }
    unused = EXTRA_LAYER_NORM["vllm" if engine == "sglang" else "sglang"]
    for i in range(1, int(cfg.get("num_hidden_layers") or 1)):
        shapes[f"layers.{i}.{unused}"] = (h,)
    return shapes


# Aux layers. Training captures layer INPUTS (hidden_states[i] of a Hugging Face model: the residual
# stream entering layer i). The two engines read a draft config's `eagle_aux_hidden_state_layer_ids`
# differently, so the conversions live here only:
# - SGLang names layer OUTPUTS and captures id+1 (srt/models/llama.py `set_eagle3_layers_to_capture`:
#   `layers_to_capture = [val + 1 for val in layer_ids]`);
# - vLLM uses the ids as input indices unchanged (0.32: v1/worker/gpu_model_runner.py
#   `_get_eagle3_aux_layers_from_config`, model_executor/models/interfaces.py `_maybe_add_hidden_state`
#   captures index idx+1 after layer idx).
# Both engines default to inputs [2, L//2, L-3] when the config names none.
Engine = Literal["sglang", "vllm"]
ENGINES: tuple[str, ...] = ("sglang", "vllm")
_AUX_OFFSET = {"sglang": 1, "vllm": 0}


def default_aux_inputs(num_layers: int) -> list[int]:
    """[2, L//2, L-3] (both engines' default) when those are three distinct layers; for shallow targets,
    where they collide (L = 6 gives [2, 3, 3]), three distinct layers spread over 1..L-1."""
    if num_layers < 4:
        raise ValueError(f"a target with {num_layers} layers has too few for three distinct aux layers")
    base = [2, num_layers // 2, num_layers - 3]
    if len(set(base)) == 3 and base == sorted(base):
        return base
    top = num_layers - 1
    return [1, 1 + (top - 1) // 2, top]


def aux_input_problem(inputs: list[int], num_layers: int, count: int | None = 3) -> tuple[str, str] | None:
    """(code, why) these captured layer inputs cannot train or serve a draft, or None when they can:
    EAGLE-3 fuses `count` (None: any number, as SGLang 0.5.23 and vLLM 0.32 size fc from the ids) DISTINCT
    layers in increasing order, each the input of one of the target's layers."""
    if count is not None and len(inputs) != count:
        return "aux_count", f"{len(inputs)} aux layers {inputs}; EAGLE-3 fuses exactly {count}"
    if not inputs:
        return "aux_count", "no aux layers; EAGLE-3 fuses at least one"
    if len(set(inputs)) != len(inputs):
        return (
            "aux_repeat",
            f"aux layers {inputs} repeat a layer: the engine captures {len(set(inputs))} distinct ones for "
            f"an fc over {len(inputs)}",
        )
    if list(inputs) != sorted(inputs):
        return (
            "aux_order",
            f"aux layers {inputs} are not increasing: the engines concatenate them in layer order",
        )
    # Input 0 is the embedding output, which SGLang cannot name (its ids are outputs of layers).
    bad = [i for i in inputs if not 1 <= i <= num_layers - 1]
    if bad:
        return "aux_range", f"aux layers {bad} are not inputs of the target's layers 1..{num_layers - 1}"
    return None


def aux_inputs_to_config(inputs: list[int], engine: Engine = "sglang") -> list[int]:
    return [int(i) - _AUX_OFFSET[engine] for i in inputs]


def aux_config_to_inputs(config_ids: list[int], engine: Engine = "sglang") -> list[int]:
    return [int(i) + _AUX_OFFSET[engine] for i in config_ids]


def aux_ids(cfg: dict) -> list[int] | None:
    """The config-convention aux ids a draft config declares, or None (SGLang then uses its default)."""
    eagle = cfg.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else [int(i) for i in ids]


class TargetInfo:
    """The three numbers of the target a draft must agree with."""

    def __init__(self, hidden_size: int, num_layers: int, vocab_size: int, source: str = ""):
        self.hidden_size = int(hidden_size)
        self.num_layers = int(num_layers)
        self.vocab_size = int(vocab_size)
        self.source = source

    def as_dict(self) -> dict:
        return {
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "vocab_size": self.vocab_size,
            "source": self.source,
        }


def load_target_info(path: str | Path) -> TargetInfo:
    """A target's config.json (or its folder). Multimodal targets (Kimi-K2.5) nest the text model's
    config under `text_config`; the hidden states the draft sees are the text model's."""
    p = Path(path)
    if p.is_dir():
        p = p / CONFIG_FILE
    if not p.is_file():
        raise FileNotFoundError(f"target config {p} not found: pass the target's config.json or its folder")
    cfg = read_config_json(p, "target config")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    missing = [
        k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in text and k not in cfg
    ]
    if missing:
        raise ValueError(f"target config {p} lacks {', '.join(missing)} (also looked under text_config)")
    get = lambda k: text.get(k, cfg.get(k))  # noqa: E731
    for k in ("hidden_size", "num_hidden_layers", "vocab_size"):
        if type(get(k)) is not int or get(k) < 1:
            raise ValueError(f"target config {p}: {k} is {get(k)!r}, not a positive integer")
    if get("num_hidden_layers") < 4:
        # three distinct aux layers strictly inside the stack (default_aux_inputs)
        raise ValueError(
            f"target config {p}: num_hidden_layers is {get('num_hidden_layers')}; an EAGLE-3 draft needs a "
            "target of at least 4 layers (three distinct aux layers): pass the target's own config.json"
        )
    return TargetInfo(get("hidden_size"), get("num_hidden_layers"), get("vocab_size"), str(p))


def read_config_json(path: str | Path, what: str = "config") -> dict:
    """A config.json as a dict, or ValueError in one line (not JSON, nested past the parser's
    recursion limit, not an object): the file is the operator's, the traceback would not help."""
    try:
        cfg = json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e).splitlines()[0]
        raise ValueError(f"{what} {path} is not valid JSON ({why})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{what} {path} holds a JSON {type(cfg).__name__}, not an object of fields")
    return cfg
