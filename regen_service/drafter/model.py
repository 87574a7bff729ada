"""The EAGLE-3 draft: `fc`, one Llama decoder layer (`midlayer`), `norm`, `lm_head`, plus `d2t`/`t2d`.

Module names are SGLang's checkpoint keys (LlamaForCausalLMEagle3), so `draft_state_dict()` exports
with no renaming. The frozen `embed_tokens` is the target's and is left out of that state dict
(SGLang replaces the draft's embedding with the target's at load). Attention takes a per-step cache:
the first entry holds the keys/values of every prefix position (causal); each later entry holds one
key/value per query position (the draft's own earlier steps), as SpecForge's training-time test and
chain decoding both need. The TTT loss lives in ttt.py, the vocabulary in vocab.py.
Imports torch only (the GPU benchmark runs it where pydantic may be missing).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

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
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (Llama's rotate-half form). x: [B, h, T, d]; positions: [B, T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.float()[:, None, :, None] * inv  # [B, 1, T, d/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.c = c
        h, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: list) -> torch.Tensor:
        """x: [B, T, 2H]. Appends this step's (k, v) to `cache` and attends to all of it.

        cache[0] is the prefix (length Tk >= T; query t sits at key Tk - T + t, causal); every later
        entry has exactly one key per query (that query's own earlier draft steps)."""
        c = self.c
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta)
        rep = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        cache.append((k, v))
        scale = 1.0 / math.sqrt(c.head_dim)
        k0, v0 = cache[0]
        tk = k0.shape[2]
        s0 = torch.matmul(q, k0.transpose(-1, -2)) * scale  # [B, h, T, Tk]
        qi = torch.arange(t, device=x.device)[:, None] + (tk - t)
        s0 = s0.masked_fill(torch.arange(tk, device=x.device)[None, :] > qi, float("-inf"))
        diag = [((q * kj).sum(-1, keepdim=True) * scale) for kj, _ in cache[1:]]  # each [B, h, T, 1]
        p = torch.softmax(torch.cat([s0, *diag], -1).float(), -1).to(q.dtype)
        out = torch.matmul(p[..., :tk], v0)
        for j, (_, vj) in enumerate(cache[1:]):
            out = out + p[..., tk + j : tk + j + 1] * vj
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """SpecForge llama3_eagle's decoder layer: attention over [norm(embedding); norm(hidden)] (2H in)."""

    def __init__(self, c: DraftConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, emb, hidden, positions, cache) -> torch.Tensor:
        residual = hidden
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], -1)
        hidden = residual + self.self_attn(x, positions, cache)
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

    def step(self, input_ids, hidden, positions, cache):
        """One draft step: returns (output hidden [B,T,H], draft-vocab logits [B,T,N])."""
        emb = self.embed_tokens(input_ids).to(hidden.dtype)
        out = self.midlayer(emb, hidden, positions, cache)
        return out, self.lm_head(self.norm(out))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def draft_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything SGLang loads (incl. d2t, t2d), on the CPU; never the frozen embedding."""
        return {k: v.detach().cpu().clone() for k, v in self.state_dict().items() if k not in EXCLUDED_KEYS}
