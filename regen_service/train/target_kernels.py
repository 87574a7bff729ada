"""The target's side of a step in two Triton kernels: its argmax with the draft columns, and their softmax.

target_head.head_outputs makes the target's full-vocabulary logits a chunk of positions at a time and
takes two things from them: the greedy next token over the whole vocabulary and the logits of the draft
vocabulary's columns. With torch that was an argmax (aten's bf16 reduction: 1.6 ms a step at Kimi-K2.5
shapes, 8K tokens, a 163,840-wide head; 1.5 TB/s), an index_select and a cast into the fp32 output.
`argmax_select_` is one program per position: a pass over the row for the max and its first index
(per lane, reduced across lanes at the end: torch's tie rule), then the draft columns read back through
their ids (the 320 KB row was just read, mostly from L2) and written in fp32: 0.144 ms against torch's
0.301 per [780, 163840] chunk on an H200, the same values. `softmax_to` is the trainer's soft targets
(softmax of those logits, fp32 math, in the draft parameters' dtype) in one kernel: online log-sum-exp
in a first pass, the probabilities written in the second, where torch ran a softmax into fp32 and then a
cast (0.585 ms against 1.21 at [8192, 32000]).

Both take CUDA tensors whose rows are contiguous; target_head.py and trainer.py call them on CUDA and
keep torch's ops elsewhere. Imports torch; triton when first called.
"""

from __future__ import annotations

import functools

import torch

# (elements per iteration, warps per row): the fastest of 4-6 configurations each on an H200, at a
# [780, 163840] bf16 chunk (argmax and draft columns: 0.144 ms; 4096 x 8 0.163) and [8192, 32000] fp32
# logits (softmax: 0.585 ms; 4096 x 8 0.639; torch's softmax and cast 1.21)
ARGMAX = (2048, 4)
SOFTMAX = (8192, 8)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def argmax_select_kernel(
        z_ptr, cols_ptr, pred_ptr, out_ptr, V, N, stride_z, stride_o, HAS_COLS: tl.constexpr, BLOCK: tl.constexpr
    ):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)
        row = z_ptr + r * stride_z
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane, reduced once at the end
        best = tl.zeros([BLOCK], tl.int32)
        for v0 in range(0, V, BLOCK):
            z = tl.load(row + v0 + offs, mask=v0 + offs < V, other=float("-inf")).to(tl.float32)
            best = tl.where(z > m, v0 + offs, best)  # strictly greater: a lane keeps its first column
            m = tl.maximum(m, z)
        mx = tl.max(m, 0)
        tl.store(pred_ptr + r, tl.min(tl.where(m == mx, best, V), 0).to(tl.int64))
        if HAS_COLS:
            for n0 in range(0, N, BLOCK):
                inside = n0 + offs < N
                c = tl.load(cols_ptr + n0 + offs, mask=inside, other=0)
                z = tl.load(row + c, mask=inside, other=0.0)
                tl.store(out_ptr + r * stride_o + n0 + offs, z.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def softmax_kernel(z_ptr, out_ptr, N, stride_z, stride_o, BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        row = z_ptr + r * stride_z
        offs = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], -1e30, tl.float32)  # per lane, reduced once at the end
        s = tl.zeros([BLOCK], tl.float32)
        for n0 in range(0, N, BLOCK):
            z = tl.load(row + n0 + offs, mask=n0 + offs < N, other=float("-inf")).to(tl.float32)
            nm = tl.maximum(m, z)
            s = s * tl.exp(m - nm) + tl.exp(z - nm)
            m = nm
        mx = tl.max(m, 0)
        s = tl.sum(s * tl.exp(m - mx), 0)
        m = mx
        for n0 in range(0, N, BLOCK):
            inside = n0 + offs < N
            z = tl.load(row + n0 + offs, mask=inside, other=float("-inf")).to(tl.float32)
            p = tl.exp(z - m) / s
            tl.store(out_ptr + r * stride_o + n0 + offs, p.to(out_ptr.dtype.element_ty), mask=inside)

    return argmax_select_kernel, softmax_kernel


def argmax_select_(
    logits: torch.Tensor, cols: torch.Tensor | None, pred: torch.Tensor, out: torch.Tensor | None
):
    """logits [R, V] -> pred [R] (int64) = logits.argmax(-1); out [R, N] = logits[:, cols] in out's dtype
    (when cols is given). pred and out are written in place (views of the caller's whole-sequence tensors)."""
    r, v = logits.shape
    if r == 0:
        return
    assert logits.stride(1) == 1 and (out is None or out.stride(1) == 1), (
        "argmax_select_: rows must be contiguous"
    )
    has = cols is not None
    _kernels()[0][(r,)](
        logits, cols if has else pred, pred, out if has else logits, v, len(cols) if has else 0, logits.stride(0),
        out.stride(0) if has else 0, HAS_COLS=has, BLOCK=ARGMAX[0], num_warps=ARGMAX[1],
    )  # fmt: skip


def softmax_to(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """softmax(logits.float(), -1).to(dtype) over the last dim, in one kernel (CUDA)."""
    z = logits.reshape(-1, logits.shape[-1])
    z = z if z.stride(-1) == 1 else z.contiguous()
    out = torch.empty(z.shape, dtype=dtype, device=z.device)
    if z.shape[0]:
        _kernels()[1][(z.shape[0],)](
            z, out, z.shape[1], z.stride(0), out.stride(0), BLOCK=SOFTMAX[0], num_warps=SOFTMAX[1]
        )
    return out.reshape(logits.shape)
