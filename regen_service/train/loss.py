"""The draft-vocabulary loss fused with lm_head: logits made and consumed chunk by chunk.

`head_loss(x, w, row_weight, target_probs=..., prob_rows=... | target_ids=...)` returns
sum_r row_weight[r] * CE_r, where CE_r is the cross-entropy of softmax(x_r @ w.T) against the
target's distribution over the draft vocabulary (soft: the EAGLE-3 objective) or its argmax (hard).
The forward makes the logits of a few thousand rows at a time, writes the gradients w.r.t. x and w
right away (softmax - p, weighted) and keeps only those, so no [rows, vocab] fp32 logits, softmax
or log-softmax is saved for backward (the backward only scales them by the incoming gradient). The
weight's fp32 gradient goes straight into its main_grad (grads.py) when it is the step's first write
there, so no second [vocab, H] fp32 tensor is alive at the step's peak; no gradient is made under
no_grad (an evaluation). It also gives each row's CE and argmax (detached) for the step metrics.
Soft targets are read by row index (`prob_rows`) from one [M, vocab] table, so the TTT steps' shifted
targets are never copied. `reference_loss` is the plain autograd version the tests hold it to. Which
rows count and with what weight is ttt.py's. Imports torch only.
"""

from __future__ import annotations

import torch

from regen_service.train.chunks import chunk_rows
from regen_service.train.grads import mm_into, owner
from regen_service.train.loss_kernel import chunk_math_, scale_

# logits elements per chunk at most where the gradient is a tensor of its own (the CPU's math): 1 GiB in
# bf16. On CUDA the gradient is written over the logits (loss_kernel), so the same bytes hold a chunk twice
# as long: fewer chunks, fewer passes of the fp32 weight gradient through the GEMM's epilogue (2 equal
# chunks over the 7 TTT steps of an 8K sequence at a 32K draft vocabulary, 4 at 16K; on an H200 at
# Kimi-K2.5 shapes, 16K: +0.5% a step against chunks of 2^29, +1.5 GiB of peak)
CHUNK_ELEMS = 1 << 29


def _chunk_math(logits, probs, rows, ids, rw: torch.Tensor):
    """-> (CE per row, argmax, dL/dlogits weighted by rw, in logits' dtype). fp32 math inside. Soft
    targets are probs[rows]. The CPU's path; on CUDA loss_kernel.chunk_math_ computes the same in one
    kernel."""
    z = logits.float()
    lse = torch.logsumexp(z, -1, keepdim=True)
    sm = torch.exp(z - lse)
    if probs is not None:
        p = probs[rows].float()
        ce = (p * (lse - z)).sum(-1)
        grad = sm - p
    else:
        ce = lse.squeeze(-1) - z.gather(-1, ids[:, None]).squeeze(-1)
        grad = sm - torch.nn.functional.one_hot(ids, z.shape[-1]).to(z.dtype)
    return ce, z.argmax(-1), (grad * rw[:, None]).to(logits.dtype)


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, rw, probs, prob_rows, ids, buf, grad_on):
        n, v = x.shape[0], w.shape[0]
        chunk = chunk_rows(n, v, 2 * CHUNK_ELEMS if x.is_cuda else CHUNK_ELEMS)
        # CUDA: one Triton kernel, the gradient written over the logits (loss_kernel.py); else the
        # plain math (the CPU tests')
        math = chunk_math_ if x.is_cuda else _chunk_math
        # needs_input_grad reads True under no_grad too (an evaluation): no gradient made there
        want_x, want_w = grad_on and ctx.needs_input_grad[0], grad_on and ctx.needs_input_grad[1]
        gx = torch.empty_like(x) if want_x else None
        # The weight's fp32 gradient is made here, before backward knows the incoming gradient g. When
        # nothing else wrote the weight's main_grad this step, it is written there directly and scaled by
        # g in backward (no [V, H] fp32 tensor beside it: 0.9 GB at a Kimi-K2.5 draft); otherwise (a
        # second micro-batch, plain autograd) into a tensor of its own that backward adds, scaled.
        ctx.direct = want_w and buf is not None and buf.claim(w)
        gw = None
        if ctx.direct:
            gw = w.main_grad
        elif want_w:
            gw = torch.empty(w.shape, dtype=torch.float32, device=w.device)
        ce_all = torch.empty(n, dtype=torch.float32, device=x.device)
        arg_all = torch.empty(n, dtype=torch.int64, device=x.device)
        if gw is not None and n == 0:
            gw.zero_()
        for s in range(0, n, chunk):
            xc = x[s : s + chunk]
            logits = xc @ w.T
            rows = prob_rows[s : s + chunk] if probs is not None else None
            idc = ids[s : s + chunk] if ids is not None else None
            rwc = rw[s : s + chunk]
            ce, arg, g = math(logits, probs, rows, idc, rwc)
            ce_all[s : s + chunk], arg_all[s : s + chunk] = ce, arg
            if gx is not None:
                torch.mm(g, w, out=gx[s : s + chunk])
            if gw is not None:
                mm_into(gw, g.T, xc, overwrite=s == 0)
        ctx.buf, ctx.w = buf, w
        if ctx.direct:
            gw = None  # it is in main_grad already
        elif gw is not None and buf is None:
            gw = gw.to(w.dtype)  # it goes back through autograd, in w's dtype
        ctx.save_for_backward(gx, gw)
        ctx.mark_non_differentiable(ce_all, arg_all)
        return (ce_all * rw).sum(), ce_all, arg_all

    @staticmethod
    def backward(ctx, g, _ce, _arg):
        gx, gw = ctx.saved_tensors
        dx = scale_(gx, g) if gx is not None else None  # ours alone, backward runs once
        dw = None  # through autograd only without a buffer
        if ctx.direct:
            scale_(ctx.w.main_grad, g)
        elif ctx.buf is not None and gw is not None:
            ctx.buf.add(ctx.w, gw, scale=g.float())
        elif gw is not None:
            dw = gw * g.to(gw.dtype)
        return dx, dw, None, None, None, None, None, None


def _check(target_probs, prob_rows, target_ids) -> None:
    if (target_probs is None) == (target_ids is None):
        raise ValueError("head_loss takes target_probs (soft) or target_ids (hard), exactly one")
    if target_probs is not None and prob_rows is None:
        raise ValueError("head_loss: target_probs needs prob_rows (the table row of each input row)")


def head_loss(x, w, row_weight, *, target_probs=None, prob_rows=None, target_ids=None):
    """x [N, H] (normed hidden), w [V, H] (lm_head), row_weight [N] fp32. -> (loss, CE [N], argmax [N])."""
    _check(target_probs, prob_rows, target_ids)
    # the weight's fp32 gradient buffer, looked up here: autograd records out here, not inside forward
    return _FusedHeadLoss.apply(
        x, w, row_weight.float(), target_probs, prob_rows, target_ids, owner(w), torch.is_grad_enabled()
    )


def reference_loss(x, w, row_weight, *, target_probs=None, prob_rows=None, target_ids=None):
    """The same function through plain autograd (fp32 logits kept): the tests' yardstick."""
    _check(target_probs, prob_rows, target_ids)
    logp = torch.log_softmax((x @ w.T).float(), -1)
    if target_probs is not None:
        ce = -(target_probs[prob_rows].float() * logp).sum(-1)
    else:
        ce = -logp.gather(-1, target_ids[:, None]).squeeze(-1)
    return (ce * row_weight.float()).sum(), ce.detach(), logp.argmax(-1)
