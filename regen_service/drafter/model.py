"""The EAGLE-3 draft: `fc`, one Llama decoder layer (`midlayer`), `norm`, `lm_head`, plus `d2t`/`t2d`.

Module names are SGLang's checkpoint keys (LlamaForCausalLMEagle3), so `draft_state_dict()` exports
with no renaming. The frozen `embed_tokens` is the target's and is left out of that state dict
(SGLang replaces the draft's embedding with the target's at load). Attention takes a per-step cache:
the first entry holds the keys/values of every prefix position (causal); each later entry holds one
key/value per query position (the draft's own earlier steps), as SpecForge's training-time test and
chain decoding both need. Two attention paths compute the same function: `eager` (the reference:
full scores, masked, fp32 softmax; any prefix length; the CPU's) and `flex` (flexattn.py: block-sparse,
GQA without repeat_interleave; CUDA training). Rotary tables (with the target's YaRN scaling) come
from rope.py; on CUDA the norm, rotary and SwiGLU elementwise work is compiled. The TTT loss lives in
ttt.py, the vocabulary in vocab.py. Imports torch only (the GPU benchmark runs it without pydantic).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from regen_service.drafter import flexattn
from regen_service.drafter.rope import RotaryTable, apply_rope

EXCLUDED_KEYS = ("embed_tokens.weight",)


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

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> DraftConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _on(x, _rms_norm)(x, self.weight, self.eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=None)


def _on(x: torch.Tensor, fn):
    """fn compiled (fused elementwise kernels) on CUDA; plain on the CPU, where tests need no compiler."""
    return _compiled(fn) if x.is_cuda else fn


class Attention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.c = c
        self.impl = "eager"  # or "flex" (the trainer picks it; flexattn.available says where it can train)
        h, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: list) -> torch.Tensor:
        """x: [B, T, 2H]; cos/sin [B or 1, 1, T, d]. Appends this step's (k, v) to `cache` (grouped
        kv heads, not repeated) and attends to all of it.

        cache[0] is the prefix (length Tk >= T; query t sits at key Tk - T + t, causal); every later
        entry has exactly one key per query (that query's own earlier draft steps)."""
        c = self.c
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        rot = _on(x, apply_rope)
        q, k = rot(q, cos, sin), rot(k, cos, sin)
        cache.append((k, v))
        scale = 1.0 / math.sqrt(c.head_dim)
        if self.impl == "flex" and cache[0][0].shape[2] == t:
            kk = torch.cat([kj for kj, _ in cache], 2) if len(cache) > 1 else k
            vv = torch.cat([vj for _, vj in cache], 2) if len(cache) > 1 else v
            out = flexattn.ttt_attention(q, kk, vv, scale)
        else:
            out = eager_attention(q, cache, scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def eager_attention(q: torch.Tensor, cache: list, scale: float) -> torch.Tensor:
    """The reference: full [B, h, T, Tk + steps] scores, masked, fp32 softmax (today's numerics)."""
    _b, nh, t, _ = q.shape
    rep = nh // cache[0][0].shape[1]
    kv = [(kj.repeat_interleave(rep, 1), vj.repeat_interleave(rep, 1)) for kj, vj in cache]
    k0, v0 = kv[0]
    tk = k0.shape[2]
    s0 = torch.matmul(q, k0.transpose(-1, -2)) * scale  # [B, h, T, Tk]
    qi = torch.arange(t, device=q.device)[:, None] + (tk - t)
    s0 = s0.masked_fill(torch.arange(tk, device=q.device)[None, :] > qi, float("-inf"))
    diag = [((q * kj).sum(-1, keepdim=True) * scale) for kj, _ in kv[1:]]  # each [B, h, T, 1]
    p = torch.softmax(torch.cat([s0, *diag], -1).float(), -1).to(q.dtype)
    out = torch.matmul(p[..., :tk], v0)
    for j, (_, vj) in enumerate(kv[1:]):
        out = out + p[..., tk + j : tk + j + 1] * vj
    return out


class MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_on(x, _swiglu)(self.gate_proj(x), self.up_proj(x)))


class MidLayer(nn.Module):
    """SpecForge llama3_eagle's decoder layer: attention over [norm(embedding); norm(hidden)] (2H in)."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, emb, hidden, cos, sin, cache) -> torch.Tensor:
        residual = hidden
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], -1)
        hidden = residual + self.self_attn(x, cos, sin, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Draft(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.rotary = RotaryTable(c.head_dim, c.rope_theta, c.rope_scaling)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        # target id -> draft id (or -1); derived from t2d, so not saved
        self.register_buffer(
            "t2d_index", torch.full((c.vocab_size,), -1, dtype=torch.int64), persistent=False
        )

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t.to(self.d2t.device))
        self.t2d.copy_(t2d.to(self.t2d.device))
        used = self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)
        idx = torch.full_like(self.t2d_index, -1)
        idx[used] = torch.arange(used.numel(), device=used.device)
        self.t2d_index.copy_(idx)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "d2t" in state_dict:
            self.set_vocab(state_dict[prefix + "d2t"], state_dict[prefix + "t2d"])

    def set_attention(self, impl: str) -> None:
        if impl not in ("eager", "flex"):
            raise ValueError(f"attention impl {impl!r}: allowed eager, flex")
        self.midlayer.self_attn.impl = impl

    def step_hidden(self, input_ids, hidden, cos, sin, cache):
        """One draft step from rotary tables already indexed: output hidden [B,T,H] (no logits)."""
        emb = self.embed_tokens(input_ids).to(hidden.dtype)
        return self.midlayer(emb, hidden, cos, sin, cache)

    def step(self, input_ids, hidden, positions, cache):
        """One draft step: returns (output hidden [B,T,H], draft-vocab logits [B,T,N])."""
        cos, sin = self.rotary.at(positions, hidden.dtype)
        out = self.step_hidden(input_ids, hidden, cos, sin, cache)
        return out, self.lm_head(self.norm(out))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def draft_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything SGLang loads (incl. d2t, t2d), on the CPU; never the frozen embedding."""
        return {k: v.detach().cpu().clone() for k, v in self.state_dict().items() if k not in EXCLUDED_KEYS}
