"""Multi-latent attention (DeepSeek-V2's MLA) for the MLA draft, as SGLang serves it for Kimi-K2.5.

The draft layer of `Eagle3DeepseekV2ForCausalLM` (sglang 0.5.23 `srt/models/kimi_k25_eagle3.py`) is
EAGLE-3's layer with `DeepseekV2AttentionMLA` (`srt/models/deepseek_v2.py`) over the 2H-wide input
[input_layernorm(embedding); hidden_norm(hidden)]. This module computes that attention in its
unabsorbed form, which training needs and the engine's absorbed kernels equal:
  q:  q_a_proj -> q_a_layernorm -> q_b_proj -> per head [q_nope | q_rope]
  kv: kv_a_proj_with_mqa -> [c_kv | k_rope]; kv_a_layernorm(c_kv) -> kv_b_proj -> per head [k_nope | v]
k_rope is one head shared by all heads. Rotary runs on q_rope/k_rope only, interleaved (GPT-J
pairs: SGLang builds it with is_neox_style = not config.rope_interleave, default True), with the
DeepSeek YaRN tables (rope.py, `deepseek=True`); the softmax scale is 1/sqrt(qk_nope + qk_rope)
times YaRN's mscale(factor, mscale_all_dim)^2. Parameter names are SGLang's checkpoint names
(mla_format.py). The TTT cache and the eager/flex choice are layers.attend's. Imports torch only.
"""

from __future__ import annotations

import torch
from torch import nn

from regen_service.draft.config import DraftConfig
from regen_service.train.compiled import fused_on, mark_lengths
from regen_service.train.layers import RMSNorm, attend
from regen_service.train.linear import NormedPair, linear, project
from regen_service.train.rope import apply_rope, mla_softmax_scale


def interleaved_to_half(x: torch.Tensor) -> torch.Tensor:
    """Reorder the last dim from GPT-J pairs (x0, x1), (x2, x3), ... to [evens | odds], so the
    rotate-half rotation (apply_rope) turns each original pair by its own frequency. Queries and keys
    are reordered alike, so their dot products are those of the interleaved rotation."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


class MLAAttention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.c = c
        self.impl = "eager"  # or "flex": the trainer picks it, as for the Llama attention
        h2, nh = 2 * c.hidden_size, c.num_attention_heads
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.q_a_proj = nn.Linear(h2, c.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, nh * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h2, c.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, nh * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(nh * self.v_dim, c.hidden_size, bias=False)
        self.scale = mla_softmax_scale(self.nope + self.rope, c.rope_scaling)

    def forward(
        self, x: torch.Tensor | NormedPair, cos: torch.Tensor, sin: torch.Tensor, cache: list
    ) -> torch.Tensor:
        """x [B, T, 2H] (or the layer's NormedPair); cos/sin [B or 1, 1, T, qk_rope]: [B, T, H]. Appends this step's (k, v), every
        head expanded, to `cache` (layers.attend)."""
        b, t, _ = x.shape
        nh = self.c.num_attention_heads
        q_a, kv_a = project(x, [self.q_a_proj.weight, self.kv_a_proj_with_mqa.weight])
        q = linear(self.q_a_layernorm(q_a), self.q_b_proj.weight)
        q_nope, q_rope = (
            q.view(b, t, nh, self.nope + self.rope).transpose(1, 2).split([self.nope, self.rope], -1)
        )
        c_kv, k_rope = kv_a.split([self.c.kv_lora_rank, self.rope], -1)
        kv = linear(self.kv_a_layernorm(c_kv), self.kv_b_proj.weight)
        kv = kv.view(b, t, nh, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        rot = fused_on(q, apply_rope)
        q_rope, k_rope = (
            interleaved_to_half(q_rope),
            interleaved_to_half(k_rope[:, None]),
        )  # k: one head, shared
        mark_lengths((q_rope, 2), (k_rope, 2), (cos, 2), (sin, 2))
        q_rope, k_rope = rot(q_rope, cos, sin), rot(k_rope, cos, sin)
        q = torch.cat([q_nope, q_rope], -1)
        k = torch.cat([k_nope, k_rope.expand(b, nh, t, self.rope)], -1)
        out = attend(self.impl, q, k, v.contiguous(), cache, self.scale)
        return linear(out.transpose(1, 2).reshape(b, t, -1), self.o_proj.weight)
