"""The draft's building blocks: RMSNorm, SwiGLU MLP, Llama (GQA) attention and the TTT attention dispatch.

Both draft architectures use these (model.py assembles the Llama-style draft, mla_attention.py adds
the MLA attention). `attend` is the one place that chooses between the attention paths, which
compute the same function: `eager` (the reference: full scores, masked, fp32 softmax; any prefix
length; the CPU's), `fa4`, `flash` and `cudnn` (flash_ttt.py: FlashAttention-4, FlashAttention-2 or
cuDNN's fused attention over the causal prefix, the diagonal keys merged by log-sum-exp; CUDA bf16
training) and `flex` (flexattn.py: block-sparse over all steps' keys concatenated, GQA without
repeat_interleave; CUDA, fp32 too). The projections go through linear.py (weight gradients into the
fp32 buffer, the embedding half of the input never multiplied back). On CUDA the norm, rotary and
SwiGLU elementwise work is compiled (compiled.py says how). Imports torch only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from regen_service.draft.config import DraftConfig
from regen_service.train import flash_ttt, flexattn
from regen_service.train.compiled import fused_on, mark_lengths
from regen_service.train.linear import NormedPair, linear, project
from regen_service.train.rope import apply_rope


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _on_rows(x, _rms_norm, self.weight, self.eps)

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        """x normalized, in its dtype, before the weight multiplies it: forward(x) == weight * normalized(x)
        (linear.NormedPair keeps the two apart). For inputs that need no gradient (the embedding)."""
        return _on_rows(x, _normalize, self.eps)


def _on_rows(x: torch.Tensor, fn, *args) -> torch.Tensor:
    # one rank for the compiled norm: it meets [B, T, H] (a TTT step), [steps, B, T, H] (the loss's
    # stacked steps) and [N, H] (eval heads); each rank was its own compiled entry and together they
    # hit dynamo's recompile limit (8), after which the norm ran uncompiled. Flattened, one entry
    # serves them all. Its row count is dynamic from the first call: every sequence length gives
    # another, and a static first entry would be one more compile per grad mode (a norm over static H
    # loses nothing to a dynamic row count). The flattening is aten._unsafe_view, the alias autograd does
    # not track as a view (its gradient is the reshape back): a tracked view reaches dynamo with guards
    # on its base's shape, whose length is static, so the MLA draft's q_a and c_kv (column slices of one
    # projection's output) compiled the norm again at every new sequence length and hit the limit.
    flat = x.reshape(-1, x.shape[-1])
    run = fused_on(x, fn)
    if run is fn:
        return fn(flat, *args).view(x.shape)
    if flat._is_view():  # else reshape copied: a tensor of its own
        flat = torch.ops.aten._unsafe_view(x, flat.shape)
    torch._dynamo.maybe_mark_dynamic(flat, 0)
    return run(flat, *args).view(x.shape)


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * _normalize(x, eps)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class Attention(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        self.c = c
        self.impl = "eager"  # or "flash", "flex" (the trainer picks; flash_ttt.supported, flexattn.available)
        h, nh, nkv, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(2 * h, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, h, bias=False)

    def forward(
        self, x: torch.Tensor | NormedPair, cos: torch.Tensor, sin: torch.Tensor, cache: list
    ) -> torch.Tensor:
        """x: [B, T, 2H] (or the layer's NormedPair); cos/sin [B or 1, 1, T, d]. Appends this step's (k, v)
        to `cache` (grouped kv heads, not repeated) and attends to all of it (`attend`)."""
        c = self.c
        b, t, _ = x.shape
        q, k, v = project(x, [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        q = q.view(b, t, c.num_attention_heads, c.head_dim)
        k = k.view(b, t, c.num_key_value_heads, c.head_dim)
        # rotated as [B, T, h, d] and viewed as [B, h, T, d]: q, k and v all in the projections' layout,
        # the one the fused attention kernels read and write, so no transpose is copied either way
        cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)
        rot = fused_on(q, apply_rope)
        mark_lengths((q, 1), (k, 1), (cos, 1), (sin, 1))
        q, k = rot(q, cos, sin).transpose(1, 2), rot(k, cos, sin).transpose(1, 2)
        v = v.view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        out = attend(self.impl, q, k, v, cache, 1.0 / math.sqrt(c.head_dim))
        return linear(out.transpose(1, 2).reshape(b, t, -1), self.o_proj.weight)


def attend(
    impl: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: list, scale: float
) -> torch.Tensor:
    """Append this step's (k, v) to `cache` and attend over all of it: q [B, h, T, d] -> [B, h, T, dv].

    cache[0] is the prefix (length Tk >= T; query t sits at key Tk - T + t, causal); every later
    entry has exactly one key per query (that query's own earlier draft steps). `flash` and `flex` need
    the training layout (prefix length == T); anything else takes the eager reference. A TTTCache of
    packed rows (packing.py) keeps every path's prefix keys inside each query's own document."""
    cache.append((k, v))
    t = q.shape[2]
    if impl in ("fa4", "flash", "cudnn") and cache[0][0].shape[2] == t:
        return flash_ttt.ttt_attention(q, cache, scale, backend=impl)
    if impl == "flex" and cache[0][0].shape[2] == t:
        kk = torch.cat([kj for kj, _ in cache], 2) if len(cache) > 1 else k
        vv = torch.cat([vj for _, vj in cache], 2) if len(cache) > 1 else v
        return flexattn.ttt_attention(q, kk, vv, scale, getattr(cache, "doc_ids", None))
    return eager_attention(q, cache, scale)


def eager_attention(q: torch.Tensor, cache: list, scale: float) -> torch.Tensor:
    """The reference: full [B, h, T, Tk + steps] scores, masked, fp32 softmax (today's numerics); a
    packed cache's `doc_ids` [B, T] also mask the prefix keys of other documents."""
    _b, nh, t, _ = q.shape
    rep = nh // cache[0][0].shape[1]
    kv = [(kj.repeat_interleave(rep, 1), vj.repeat_interleave(rep, 1)) for kj, vj in cache]
    k0, v0 = kv[0]
    tk = k0.shape[2]
    s0 = torch.matmul(q, k0.transpose(-1, -2)) * scale  # [B, h, T, Tk]
    qi = torch.arange(t, device=q.device)[:, None] + (tk - t)
    hide = torch.arange(tk, device=q.device)[None, :] > qi
    doc = getattr(cache, "doc_ids", None)
    if doc is not None:  # packed rows (prefix length == T): keys of the query's own document only
        hide = hide | (doc[:, None, :, None] != doc[:, None, None, :])
    s0 = s0.masked_fill(hide, float("-inf"))
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
        gate, up = project(x, [self.gate_proj.weight, self.up_proj.weight])
        mark_lengths((gate, -2), (up, -2))
        return linear(fused_on(x, _swiglu)(gate, up), self.down_proj.weight)
