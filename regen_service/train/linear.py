"""The draft's matrix products with their weight gradients sent to the fp32 buffer (grads.py).

`project(x, weights)` returns `x @ w.T` for each weight. When the weights have a GradBuffer and autograd
records, a custom backward writes each weight's gradient into its fp32 `main_grad` inside the GEMM and
returns the input's gradient as one chain of products (dx = dy1 @ w1, then dx += dy2 @ w2 in place), so
the q/k/v or gate/up projections of one input add no [T, in] tensors together. Otherwise (evaluation,
a draft without a trainer) it is plain `F.linear`.

`NormedPair` is the decoder layer's input, [input_layernorm(embedding); hidden_norm(hidden)], kept as
its parts: the normalized embedding `n` (no weight applied), the norm's weight `gamma` and the hidden
half. The embedding is frozen and its tokens are data, so the only gradient that half carries is the
one into gamma, dgamma[c] = sum_t n[t, c] * (dy @ W_e)[t, c], which needs no [T, H] product: it is
sum_o W_e[o, c] * G[o, c] with G = dy^T @ n, and G is what the weight gradient takes anyway
(dW_e = G * gamma, column-wise). So the backward multiplies dy by the hidden half of the weights only
(skipping 2*T*H*out FLOPs per projection, ~5% of a Kimi-K2.5 draft step) and fixes the embedding
columns up once per step, after backward (`_embedding_fixup`, deferred through GradBuffer.defer):
dgamma from G, then G scaled by gamma in place. The forward is unchanged: x = cat(gamma * n, hidden),
the same bf16 values input_layernorm gives. Imports torch only.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from regen_service.train.compiled import fused_on, mark_lengths
from regen_service.train.grads import GradBuffer, owner


@dataclasses.dataclass
class NormedPair:
    n: torch.Tensor  # [B, T, H] the embedding normalized, in the parameters' dtype, no weight applied
    gamma: torch.Tensor  # [H] input_layernorm's weight
    hidden: torch.Tensor  # [B, T, H] hidden_norm(hidden)

    def cat(self) -> torch.Tensor:
        """[B, T, 2H]: what input_layernorm(embedding) and hidden_norm(hidden) concatenate to."""
        mark_lengths((self.n, 1), (self.hidden, 1))
        return fused_on(self.n, _scaled_cat)(self.n, self.gamma, self.hidden)

    @property
    def shape(self) -> torch.Size:
        return torch.Size([*self.hidden.shape[:-1], 2 * self.hidden.shape[-1]])


def _scaled_cat(n: torch.Tensor, gamma: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    return torch.cat([gamma * n, hidden], -1)  # compiled on CUDA: one kernel writes x


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _input_grad(dys, ws, cols: slice | None = None) -> torch.Tensor | None:
    dx = None
    for dy, w in zip(dys, ws, strict=True):
        if dy is None:
            continue
        wc = w if cols is None else w[:, cols]
        dx = _rows(dy) @ wc if dx is None else dx.addmm_(_rows(dy), wc)
    return dx


class _Project(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, buf: GradBuffer, *ws):
        # the parameters themselves, not saved copies: their identity keys the buffer (saved tensors
        # unpack as new objects); nothing changes them between forward and backward
        ctx.save_for_backward(x)
        ctx.buf, ctx.ws = buf, ws
        return tuple(F.linear(x, w) for w in ws)

    @staticmethod
    def backward(ctx, *dys):
        (x,), ws = ctx.saved_tensors, ctx.ws
        xr = _rows(x)
        for dy, w in zip(dys, ws, strict=True):
            if dy is not None:
                ctx.buf.weight_grad(w, _rows(dy), xr)
        dx = _input_grad(dys, ws) if ctx.needs_input_grad[0] else None
        return (None if dx is None else dx.view(x.shape), None, *(None for _ in ws))


def _embedding_fixup(buf: GradBuffer, w: torch.nn.Parameter, gamma: torch.nn.Parameter, h: int):
    def fix() -> None:
        g = w.main_grad[:, :h]  # G = sum over the step's uses of dy^T @ n
        buf.add(gamma, (g * w.detach()[:, :h]).sum(0))
        g.mul_(gamma.detach().float())

    return fix


class _ProjectPair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, n, gamma, hidden, buf: GradBuffer, *ws):
        x = NormedPair(n, gamma, hidden).cat()
        ctx.save_for_backward(torch.cat([n, hidden], -1))
        ctx.buf, ctx.h, ctx.gamma, ctx.ws = buf, n.shape[-1], gamma, ws  # the parameters (as _Project)
        return tuple(F.linear(x, w) for w in ws)

    @staticmethod
    def backward(ctx, *dys):
        (xn,), gamma, ws = ctx.saved_tensors, ctx.gamma, ctx.ws
        xr, h, buf = _rows(xn), ctx.h, ctx.buf
        for dy, w in zip(dys, ws, strict=True):
            if dy is not None:
                buf.weight_grad(w, _rows(dy), xr)
                buf.defer(("embedding", id(w)), _embedding_fixup(buf, w, gamma, h))
        dh = _input_grad(dys, ws, slice(h, None)) if ctx.needs_input_grad[2] else None
        shape = (*xn.shape[:-1], h)
        return (None, None, None if dh is None else dh.view(shape), None, *(None for _ in ws))


def project(x: torch.Tensor | NormedPair, ws: list[torch.nn.Parameter]) -> tuple[torch.Tensor, ...]:
    """x @ w.T for each of ws (x a tensor [..., in] or the layer's NormedPair)."""
    buf = owner(ws[0])
    pair = isinstance(x, NormedPair)
    if buf is None or (pair and owner(x.gamma) is not buf):
        xx = x.cat() if pair else x
        return tuple(F.linear(xx, w) for w in ws)
    if pair:
        return _ProjectPair.apply(x.n, x.gamma, x.hidden, buf, *ws)
    return _Project.apply(x, buf, *ws)


def linear(x: torch.Tensor, w: torch.nn.Parameter) -> torch.Tensor:
    return project(x, [w])[0]
