"""The draft's architecture: `DraftConfig`, the sizes one EAGLE-3 draft layer is built from.

Written into every checkpoint as `draft_config` (`to_dict`/`from_dict`, unknown keys ignored) and read
back by export, which turns it into the engine's config.json (sglang_format.py, mla_format.py). A plain
dataclass with no torch and no pydantic: the model (train/model.py, layers.py, mla_attention.py) builds
from it, the GPU benchmark runs it without pydantic, and nothing here knows how a layer is computed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Literal


@dataclass
class DraftConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's vocabulary (embedding rows, t2d length)
    draft_vocab_size: int
    target_hidden_size: int
    rope_scaling: dict | None = (
        None  # the target's (YaRN for Kimi-K2.5): the engine applies it from config.json
    )
    draft_arch: Literal["llama", "mla"] = "llama"
    # MLA attention dims (draft_arch "mla"; the target's for an MLA target, Kimi-K2.5: 1536, 512, 128, 64, 128)
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    @property
    def rotary_dim(self) -> int:
        return self.qk_rope_head_dim if self.draft_arch == "mla" else self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DraftConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
