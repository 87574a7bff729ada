"""Rotary position tables for the draft: plain RoPE and YaRN, built once and indexed by position.

The serving engine builds the draft's rotary embedding from config.json's `rope_theta` and
`rope_scaling` (SGLang/vLLM `get_rope`), so training must rotate the same way: YaRN here follows
their `YaRNScalingRotaryEmbedding` (inv_freq blended between interpolation and extrapolation by the
beta_fast/beta_slow correction range; cos/sin scaled by yarn_get_mscale(factor) * attn_factor; the
DeepSeek-only `mscale`/`mscale_all_dim` keys are ignored there, so they are ignored here). The MLA
draft's attention (DeepseekV2AttentionMLA) rotates with `DeepseekScalingRotaryEmbedding` instead
(`deepseek=True`): the same inv_freq, cos/sin scaled by mscale(factor, mscale) / mscale(factor,
mscale_all_dim) * attn_factor, and the softmax scale multiplied by mscale(factor, mscale_all_dim)^2
(`mla_softmax_scale`; sglang 0.5.23 `layers/rotary_embedding/rope_variant.py`,
`configs/model_config.compute_mla_mscale_scaling`). Other scaling types are refused rather than
trained wrong. Applying the rotation (rotate-half form) is
`apply_rope`; which positions each TTT step uses is ttt.py's. Imports torch only.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_SCALING = ("yarn",)


def _yarn_correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (rotations * 2 * math.pi))) / (2 * math.log(base))


def scaling_type(scaling: dict | None) -> str | None:
    """A rope_scaling's type (`rope_type`, or transformers 4's `type`); None for none or "default"."""
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    return None if kind in (None, "default") else kind


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def mla_softmax_scale(qk_head_dim: int, scaling: dict | None) -> float:
    """DeepseekV2AttentionMLA's softmax scale: 1/sqrt(qk_nope + qk_rope), times mscale(factor,
    mscale_all_dim)^2 under YaRN (1 when mscale_all_dim is unset)."""
    base = qk_head_dim**-0.5
    if scaling_type(scaling) is None:
        return base
    m = yarn_mscale(float(scaling.get("factor", 1.0)), float(scaling.get("mscale_all_dim") or 0.0))
    return base * m * m


def inv_freq_and_scale(
    head_dim: int, theta: float, scaling: dict | None, deepseek: bool = False
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] fp32, cos/sin multiplier) for `rope_scaling` (None = plain RoPE);
    `deepseek`: the MLA attention's variant of the multiplier."""
    extrap = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = scaling_type(scaling)
    if kind is None:
        return extrap.float(), 1.0
    if kind not in SUPPORTED_SCALING:
        raise ValueError(
            f"rope_scaling type {kind!r} is not supported by the draft trainer (supported: default, "
            f"{', '.join(SUPPORTED_SCALING)}); train a draft without it or add it to rope.py"
        )
    factor = float(scaling["factor"])
    orig = int(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))
    low = max(math.floor(_yarn_correction_dim(beta_fast, head_dim, theta, orig)), 0)
    high = min(math.ceil(_yarn_correction_dim(beta_slow, head_dim, theta, orig)), head_dim - 1)
    if low == high:
        high += 0.001  # the engines' guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    mask = (1 - ramp) * float(scaling.get("extrapolation_factor", 1.0))
    inv = (extrap / factor) * (1 - mask) + extrap * mask
    attn_factor = float(scaling.get("attn_factor", 1.0))
    if deepseek:
        ratio = yarn_mscale(factor, float(scaling.get("mscale", 1.0))) / yarn_mscale(
            factor, float(scaling.get("mscale_all_dim") or 0.0)
        )
        return inv.float(), ratio * attn_factor
    return inv.float(), yarn_mscale(factor) * attn_factor


class RotaryTable:
    """cos/sin [P, head_dim] for positions 0..P-1, grown on demand and kept per device/dtype, so a
    training step indexes a table instead of recomputing trigonometry at every TTT step."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, deepseek: bool = False):
        self.inv_freq, self.mscale = inv_freq_and_scale(head_dim, theta, scaling, deepseek)
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, length: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, dtype)
        have = self._tables.get(key)
        if have is None or have[0].shape[0] < length:
            n = max(length, 2 * have[0].shape[0] if have is not None else length)
            ang = torch.arange(n, dtype=torch.float64)[:, None] * self.inv_freq.double()[None]
            ang = torch.cat([ang, ang], -1)
            have = ((ang.cos() * self.mscale).to(device, dtype), (ang.sin() * self.mscale).to(device, dtype))
            self._tables[key] = have
        return have

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, d] at `positions` [B, T]."""
        cos, sin = self.get(int(positions.max()) + 1, positions.device, dtype)
        return cos[positions][:, None], sin[positions][:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (Llama's, neox style). x [B, h, T, d] or [B, T, h, d]; cos/sin broadcastable to it."""
    d = x.shape[-1]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin
