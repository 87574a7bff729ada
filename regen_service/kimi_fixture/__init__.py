"""A faithful, scaled-down Kimi-K2.5 model folder for tests and dry runs, built locally (no download).

`build_kimi_fixture(out_dir)` writes what the real `moonshotai/Kimi-K2.5` folder holds, minus the
weights: `config.json` (`model_type: kimi_k25`, `auto_map` to remote code, a DeepSeek-V3-style
`text_config` with MLA fields, routed experts and YaRN `rope_scaling`, a scaled vocabulary),
`tokenizer_config.json` (`auto_map` to the local slow `tokenization_kimi.TikTokenTokenizer`, Kimi's
special tokens at Kimi's offsets after the base vocabulary, media markers included), `tiktoken.model` (BPE ranks derived from
the demo tokenizer's byte-level merges), the remote-code files and `chat_template.jinja` copied from
files/. Which real behaviours each file reproduces, and from which public source, is in
docs/kimi-k25.md. Loading the folder needs `trust_remote_code` (that opt-in is remote_code.py's).
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

FILES = Path(__file__).parent / "files"
DEMO_TOKENIZER = Path(__file__).parent.parent / "demo" / "tokenizer" / "tokenizer.json"

# Kimi-K2.5's special tokens as offsets from its first special id (163584 = base vocabulary size).
SPECIAL_OFFSETS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    18: "<|media_begin|>",  # 163602 in the real vocabulary
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",  # 163605: config.json's media_placeholder_token_id
    22: "<think>",
    23: "</think>",
    254: "[UNK]",
    255: "[PAD]",
}
# Structural markers are special (dropped by skip_special_tokens); <think> and </think> are not,
# so decoded answers keep their thinking markers (as with the real tokenizer's config).
NOT_SPECIAL = {"<think>", "</think>"}


def _byte_decoder() -> dict[str, int]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def bpe_ranks() -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then each demo-tokenizer merge in training order."""
    dec = _byte_decoder()
    merges = json.loads(DEMO_TOKENIZER.read_text())["model"]["merges"]
    ranks = {bytes([b]): b for b in range(256)}
    for m in merges:
        left, right = m if isinstance(m, list) else m.split(" ", 1)
        tok = bytes(dec[c] for c in left + right)
        ranks.setdefault(tok, len(ranks))
    return ranks


def text_config(vocab_size: int) -> dict:
    """DeepSeek-V3's text model shape (as Kimi-K2.5's text_config), scaled down."""
    return {
        "model_type": "kimi_k2",
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.827,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "kv_lora_rank": 16,
        "q_lora_rank": 24,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": vocab_size - 256,
        "eos_token_id": vocab_size - 256 + 1,
        "torch_dtype": "bfloat16",
    }


def build_kimi_fixture(out_dir: str | Path) -> Path:
    """Write the folder; returns its path. Deterministic: same repo, same bytes."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ranks = bpe_ranks()
    base = len(ranks)
    with open(out / "tiktoken.model", "w") as f:
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(tok).decode()} {rank}\n")
    vocab = base + 256
    specials = {base + off: name for off, name in SPECIAL_OFFSETS.items()}
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "model_type": "kimi_k25",
        "text_config": text_config(vocab),
        "vision_config": {"model_type": "moonvit", "hidden_size": 32, "num_hidden_layers": 1},
        "media_placeholder_token_id": base + 21,
        "pad_token_id": base + 255,
        "ignore_index": -100,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    tok_config = {
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "model_max_length": 262144,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(i): {
                "content": name,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": name not in NOT_SPECIAL,
            }
            for i, name in sorted(specials.items())
        },
    }
    generation = {"bos_token_id": base, "eos_token_id": base + 2, "max_length": 262144}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in ("tokenization_kimi.py", "tool_declaration_ts.py", "chat_template.jinja"):
        shutil.copyfile(FILES / name, out / name)
    return out
