"""What SGLang's `LlamaForCausalLMEagle3` loads: key names, shapes, config fields, aux-layer conventions.

The single source of truth for export, validation, conversion and the launch preflight. Facts come
from SGLang's `srt/models/llama_eagle3.py` (see shared/reference/eagle3.md): its loader tries each
tensor name as is and with a `model.` prefix and SKIPS names it does not know without a message, so
every name we write or accept must be one of these. Reading checkpoints is left to validate.py.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Literal

ARCHITECTURE = "LlamaForCausalLMEagle3"
SPEC_ALGORITHM = "EAGLE3"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"

# The decoder layer's tensors, relative to `midlayer.` (SGLang) or `layers.0.` (speculators).
LAYER_KEYS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "hidden_norm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
REQUIRED_KEYS = (
    *(f"midlayer.{k}" for k in LAYER_KEYS),
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)
# Loaded when present, never required: SGLang swaps in the target's embedding after loading, and
# `fc.bias` only exists when the config says `"bias": true`.
OPTIONAL_KEYS = ("embed_tokens.weight", "fc.bias")

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


def head_dim(cfg: dict) -> int:
    """SGLang's Llama attention: `head_dim` when the config has it, else hidden_size // heads."""
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    return int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])


def expected_shapes(cfg: dict, target_hidden: int) -> dict[str, tuple[int, ...]]:
    """Shape of every required weight for a draft config, as SGLang allocates it."""
    h = int(cfg["hidden_size"])
    inter = int(cfg["intermediate_size"])
    hd = head_dim(cfg)
    q = int(cfg["num_attention_heads"]) * hd
    kv = int(cfg["num_key_value_heads"]) * hd
    return {
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "fc.weight": (h, 3 * target_hidden),
        "norm.weight": (h,),
        "lm_head.weight": (int(cfg["draft_vocab_size"]), h),
        "d2t": (int(cfg["draft_vocab_size"]),),
        "t2d": (int(cfg["vocab_size"]),),
    }


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


def aux_input_problem(inputs: list[int], num_layers: int) -> tuple[str, str] | None:
    """(code, why) these captured layer inputs cannot train or serve a draft, or None when they can:
    EAGLE-3 fuses three DISTINCT layers in increasing order, each the input of one of the target's layers."""
    if len(inputs) != 3:
        return "aux_count", f"{len(inputs)} aux layers {inputs}; EAGLE-3 fuses exactly 3"
    if len(set(inputs)) != 3:
        return (
            "aux_repeat",
            f"aux layers {inputs} repeat a layer: the engine captures fewer than 3 distinct ones",
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
    cfg = json.loads(p.read_text())
    text = cfg.get("text_config") or cfg
    missing = [
        k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in text and k not in cfg
    ]
    if missing:
        raise ValueError(f"target config {p} lacks {', '.join(missing)} (also looked under text_config)")
    get = lambda k: text.get(k, cfg.get(k))  # noqa: E731
    return TargetInfo(get("hidden_size"), get("num_hidden_layers"), get("vocab_size"), str(p))


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
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    for entry in header.values():
        entry["data_start"] = 8 + n
    return header
