"""The head loss's chunk math as one Triton kernel on CUDA: a row's logits read twice, once from DRAM.

loss.py turns each chunk of draft logits [R, V] into each row's cross-entropy against the target, its
argmax and dL/dlogits = (softmax - p) * row_weight, which the lm_head's two gradient GEMMs read. The
compiled `_chunk_math` did this in ~3 passes over each row, reading the logits and the target's
probabilities from memory more than once: 6.8 ms a step at Kimi-K2.5 draft shapes, 8K tokens (7 TTT steps
of 8,192 rows, 32,000 wide), ~3x what its bytes need. Here one program owns one row:

- pass 1 reads the row's logits once: per lane the running max, its first index and the running sum of
  exp (online log-sum-exp), in fp32, reduced across lanes at the end (the max's first column overall:
  torch's argmax tie rule);
- pass 2 reads them again (the row, 64 KB, was just read: mostly from L2) with the target's row (soft: probs[rows[r]],
  read through the index, nothing gathered; hard: the one id), sums ce = sum p (lse - z) as the compiled
  math does, and writes the weighted gradient over the logits, in place: no second [R, V] tensor.

On an H200, a [14336, 32000] chunk: 0.88 ms against the compiled math's 1.41 (soft targets). `scale_` is
the backward's multiply by the incoming gradient, vectorized.

Same formulas as `loss._chunk_math`, fp32 inside, the gradient rounded once to the logits' dtype; the
device numerics mode (scripts/bench_train.py --mode numerics) holds the head loss to the reference.
Imports torch; triton when first called.
"""

from __future__ import annotations

import functools

import torch

# logits per iteration of a row's loop, warps per row: the fastest of 7 configurations on an H200 at a
# [14336, 32000] chunk (0.88 ms soft, 0.78 hard; 4096 x 8 0.96 and 0.86; 8192 x 8 1.54 and 1.45)
BLOCK_V = 2048
NUM_WARPS = 8


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def chunk_math_kernel(
        z_ptr, p_ptr, rows_ptr, ids_ptr, rw_ptr, ce_ptr, arg_ptr, V, stride_z, stride_p,
        SOFT: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_V)
        zrow = z_ptr + r * stride_z
        # per lane: running max, its first column, sum of exp below it; reduced across lanes once at the
        # end, so the loop streams (no block-wide reduction between one load and the next)
        m = tl.full([BLOCK_V], -1e30, tl.float32)  # finite: a lane past V keeps exp(m - m) defined
        s = tl.zeros([BLOCK_V], tl.float32)
        best = tl.zeros([BLOCK_V], tl.int32)
        for v0 in range(0, V, BLOCK_V):
            z = tl.load(zrow + v0 + cols, mask=v0 + cols < V, other=float("-inf")).to(tl.float32)
            nm = tl.maximum(m, z)
            s = s * tl.exp(m - nm) + tl.exp(z - nm)
            best = tl.where(z > m, v0 + cols, best)  # strictly greater: a lane keeps its first column
            m = nm
        mx = tl.max(m, 0)
        lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), 0))
        arg = tl.min(tl.where(m == mx, best, V), 0).to(tl.int64)  # the first column holding the max
        rw = tl.load(rw_ptr + r)
        if SOFT:
            prow = p_ptr + tl.load(rows_ptr + r).to(tl.int64) * stride_p
        else:
            tid = tl.load(ids_ptr + r).to(tl.int64)
        ce = tl.zeros([BLOCK_V], tl.float32)
        for v0 in range(0, V, BLOCK_V):
            inside = v0 + cols < V
            z = tl.load(zrow + v0 + cols, mask=inside, other=0.0).to(tl.float32)
            if SOFT:
                p = tl.load(prow + v0 + cols, mask=inside, other=0.0).to(tl.float32)
                ce += p * (lse - z)
            else:
                p = tl.where(v0 + cols == tid, 1.0, 0.0)
                ce += tl.where(v0 + cols == tid, lse - z, 0.0)
            g = (tl.exp(z - lse) - p) * rw
            tl.store(zrow + v0 + cols, g.to(z_ptr.dtype.element_ty), mask=inside)
        tl.store(ce_ptr + r, tl.sum(ce, 0))
        tl.store(arg_ptr + r, arg)

    @triton.jit
    def scale_kernel(x_ptr, s_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        tl.store(x_ptr + offs, (x.to(tl.float32) * tl.load(s_ptr).to(tl.float32)).to(x.dtype), mask=mask)

    return chunk_math_kernel, scale_kernel


def chunk_math_(logits, probs, rows, ids, rw: torch.Tensor):
    """loss._chunk_math's results, the gradient written over `logits` ([R, V], CUDA, rows contiguous):
    -> (CE per row fp32, argmax int64, logits now holding dL/dlogits weighted by rw)."""
    n, v = logits.shape
    ce = torch.empty(n, dtype=torch.float32, device=logits.device)
    arg = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return ce, arg, logits
    assert logits.stride(1) == 1, "chunk_math_: each row of logits must be contiguous"
    soft = probs is not None
    if soft:
        assert probs.stride(1) == 1, "chunk_math_: each row of the target probabilities must be contiguous"
    _kernels()[0][(n,)](
        logits, probs if soft else logits, rows if soft else ids, ids if not soft else rows, rw.contiguous(),
        ce, arg, v, logits.stride(0), probs.stride(0) if soft else 0,
        SOFT=soft, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS,
    )  # fmt: skip
    return ce, arg, logits


def scale_(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x *= s in place, s a 1-entry tensor on x's device: what `x.mul_(s.to(x.dtype))` computes. torch's
    elementwise multiply by a 0-dim CUDA tensor broadcasts it with stride 0 and so runs its unvectorized
    kernel (1.4 TB/s on the head loss's [57344, 7168] input gradient at Kimi-K2.5 shapes, 8K tokens); this
    reads s once per program. Contiguous CUDA tensors; anything else goes through torch."""
    s = s.to(x.dtype)
    if not (x.is_cuda and x.is_contiguous()) or x.numel() == 0:
        return x.mul_(s)
    block = 4096
    _kernels()[1][(_cdiv(x.numel(), block),)](x, s, x.numel(), BLOCK=block, num_warps=8)
    return x


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
