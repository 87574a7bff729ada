"""The draft's building blocks: RMSNorm, SwiGLU MLP, Llama (GQA) attention and the TTT attention dispatch.

Both draft architectures use these (model.py assembles the Llama-style draft, mla_attention.py adds
the MLA attention). `attend` is the one place that chooses between the two attention paths, which
compute the same function: `eager` (the reference: full scores, masked, fp32 softmax; any prefix
length; the CPU's) and `flex` (flexattn.py: block-sparse, GQA without repeat_interleave; CUDA
training). On CUDA the norm, rotary and SwiGLU elementwise work is compiled. Imports torch only.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from regen_service.draft.config import DraftConfig
from regen_service.train import flexattn
from regen_service.train.rope import apply_rope


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one rank for the compiled norm: it meets [B, T, H] (a TTT step), [steps, B, T, H] (the loss's
        # stacked steps) and [N, H] (eval heads); each rank was its own compiled entry and together they
        # hit dynamo's recompile limit (8), after which the norm ran uncompiled. Flattened, one entry
        # serves them all (a view: these inputs are contiguous). Its row count is dynamic from the first
        # call: every sequence length gives another, and a static first entry would be one more compile
        # per grad mode (a norm over static H loses nothing to a dynamic row count).
        flat = x.reshape(-1, x.shape[-1])
        fn = fused_on(x, _rms_norm)
        if fn is not _rms_norm:
            torch._dynamo.maybe_mark_dynamic(flat, 0)
        return fn(flat, self.weight, self.eps).view(x.shape)


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


def fused_on(x: torch.Tensor, fn):
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
        kv heads, not repeated) and attends to all of it (`attend`)."""
        c = self.c
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        rot = fused_on(x, apply_rope)
        q, k = rot(q, cos, sin), rot(k, cos, sin)
        out = attend(self.impl, q, k, v, cache, 1.0 / math.sqrt(c.head_dim))
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def attend(
    impl: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: list, scale: float
) -> torch.Tensor:
    """Append this step's (k, v) to `cache` and attend over all of it: q [B, h, T, d] -> [B, h, T, dv].

    cache[0] is the prefix (length Tk >= T; query t sits at key Tk - T + t, causal); every later
    entry has exactly one key per query (that query's own earlier draft steps). `flex` needs the
    training layout (prefix length == T); anything else takes the eager reference."""
    cache.append((k, v))
    t = q.shape[2]
    if impl == "flex" and cache[0][0].shape[2] == t:
        kk = torch.cat([kj for kj, _ in cache], 2) if len(cache) > 1 else k
        vv = torch.cat([vj for _, vj in cache], 2) if len(cache) > 1 else v
        return flexattn.ttt_attention(q, kk, vv, scale)
    return eager_attention(q, cache, scale)


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
        return self.down_proj(fused_on(x, _swiglu)(self.gate_proj(x), self.up_proj(x)))
