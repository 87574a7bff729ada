"""TTT attention as a causal flash attention over the prefix plus the diagonal keys, merged by log-sum-exp.

At TTT step n each query t attends to the step-0 keys causally and to one key in each of the n later
segments: its own earlier draft steps (flexattn.py states the mask). flex attention runs that as one
block-sparse kernel over the concatenated keys; this module splits it in two exact parts instead:

- the causal part is FlashAttention-2 as PyTorch ships it (`aten._scaled_dot_product_flash_attention`
  and its `_backward`, torch 2.11's and 2.13's schemas), cuDNN's fused attention (the same for
  `_scaled_dot_product_cudnn_attention`) or FlashAttention-4 where its package is installed (fa4.py),
  each of which returns the rows' log-sum-exp `lse_c`;
- the n diagonal keys of step n add one score per query each, s_j = q . k_j * scale, folded in by
  `ttt_merge.merge` (one Triton kernel on CUDA for every length and key count): L = logaddexp(lse_c,
  s_1..s_n), out = out_c e^(lse_c - L) + sum_j e^(s_j - L) v_j, fp32, so the merged output and the
  global log-sum-exp L are exactly the masked softmax's.

Backward: as ring attention does it, the flash backward is called with the merged output and the
global L, so its P = exp(QK^T * scale - L) are the global softmax's probabilities and its
dS = P (dP - D), D = rowsum(dO * O), are the causal block's exact gradients; the diagonal keys' part
is the same formula on one score each (`ttt_merge.merge_grad`, adding into the causal kernel's dq in
place). A key read by several steps has its gradient summed across them inside that kernel
(`KeyGrads`, through `TTTCache`), not by autograd. Nothing is concatenated: flex needs every step's
keys in one [T * (n+1)] tensor, copied at each step and saved for backward.

FlashAttention-2 takes bf16/fp16 and one head dim for q, k and v: the MLA draft's values (128) are
zero-padded to its qk head dim (192), and for FlashAttention-2 and cuDNN grouped keys (GQA) are
expanded to the query heads (dK, dV summed back); FlashAttention-4 reads them as they are (given the
grouped keys, cuDNN 9.19's backward ran 0.3-2.7% slower on an H200, so it keeps the repeat).
Packed rows (packing.py): the cache's `segments` run the causal kernel once per document, on views of the
row (nothing copied in), so no query sees another document's keys; the diagonal keys are each query's own.
`reference=True` (and any CPU tensor) computes the causal part and the merge with plain torch by the
same formulas, so the CPU tests hold the merge and its backward to the eager attention's autograd. Imports torch only (ttt_merge imports triton on CUDA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from regen_service.train import fa4, ttt_merge

BACKENDS = ("fa4", "flash", "cudnn", "reference")
# FlashAttention-2's largest head dim; cuDNN's and FlashAttention-4's taken here
MAX_HEAD_DIM = {"flash": 256, "cudnn": 128, "fa4": 128}
# the kernels that read grouped keys (GQA) as they are; the others get the kv heads repeated
READS_GQA = ("fa4",)


def takes(dtype: torch.dtype, qk_head_dim: int, backend: str = "flash") -> bool:
    """Whether the backend's kernel takes these parameters: half precision, a head dim it has."""
    return (
        dtype in (torch.bfloat16, torch.float16)
        and qk_head_dim <= MAX_HEAD_DIM[backend]
        and qk_head_dim % 8 == 0
    )


def supported(dtype: torch.dtype, qk_head_dim: int, device: torch.device, backend: str = "flash") -> bool:
    """Whether this backend trains here: a CUDA GPU of Ampere or later (the fused kernels need sm80+;
    FlashAttention-4 sm90+ and its package installed, fa4.py) and parameters its kernel takes."""
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(device) >= (8, 0)
        and takes(dtype, qk_head_dim, backend)
        and (
            backend != "fa4"
            or (torch.cuda.get_device_capability(device) >= fa4.MIN_CAPABILITY and fa4.installed())
        )
    )


def _row_dot(a, b):
    return (a.float() * b.float()).sum(-1)


def _causal_fwd(q, k, v, scale: float, backend: str):
    """-> (out [B,h,T,d] in q's dtype, lse raw (the kernel's layout), aux for the backward)."""
    if backend == "reference":
        s = (q.float() @ k.float().transpose(-1, -2)) * scale
        t = q.shape[2]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        lse = torch.logsumexp(s, -1)
        return (torch.exp(s - lse[..., None]) @ v.float()).to(q.dtype), lse, None
    if backend == "fa4":
        return (*fa4.forward(q, k, v, scale), None)
    if backend == "cudnn":
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, True, False, scale=scale
        )
        return r[0], r[1], r[2:8]  # cum_seq_q, cum_seq_k, max_q, max_k, philox seed, philox offset
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
    return r[0], r[1], r[2:8]  # cum_seq_q, cum_seq_k, max_q, max_k, philox seed, philox offset


def _causal_bwd(dout, q, k, v, out, lse_raw, aux, scale: float, backend: str):
    if backend == "reference":
        t = q.shape[2]
        s = (q.float() @ k.float().transpose(-1, -2)) * scale
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        p = torch.exp(s - lse_raw[..., None])
        do = dout.float()
        dv = p.transpose(-1, -2) @ do
        ds = p * (do @ v.float().transpose(-1, -2) - _row_dot(dout, out)[..., None])
        return (ds @ k.float()) * scale, (ds.transpose(-1, -2) @ q.float()) * scale, dv
    if backend == "fa4":
        return fa4.backward(dout, q, k, v, out, lse_raw, scale)
    cq, ck, mq, mk, seed, offset = aux
    if backend == "cudnn":  # attn_bias None: an undefined tensor, as autograd passes it
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse_raw, seed, offset, None, cq, ck, mq, mk, 0.0, True, scale=scale
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse_raw, cq, ck, mq, mk, 0.0, True, seed, offset, scale=scale
    )


def _rows(lse_raw: torch.Tensor, shape) -> torch.Tensor:
    """The kernel's log-sum-exp ([B,h,T], or cuDNN's [B,h,T,1]) as [B,h,T] fp32 (a view where it can)."""
    b, h, t = shape
    return lse_raw.reshape(b, h, -1)[..., :t].float()


def _in_layout(like: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """src in `like`'s strides and dtype (the kernel's layout), its value dims zero-padded to like's."""
    out = torch.empty_like(like)
    dv = src.shape[-1]
    out[..., :dv] = src
    if dv < like.shape[-1]:
        out[..., dv:] = 0
    return out


class KeyGrads:
    """The diagonal keys' gradients, summed across the TTT steps that read them, for one unroll.

    Key j (step j's k and v) is read by steps j, j+1, ..., and backward meets those steps last to first:
    step j's attention runs its backward after every later step's (their gradients reach step j's
    output only through step j+1's input). So each later step adds its part into `sums[j]` inside the
    merge's backward kernel and hands autograd None for that key, and step j, the last reader, returns
    the total. Autograd would otherwise add the per-step gradients one pair at a time: (n-1) n / 2
    extra passes over the keys and values per sequence (15 pairs at 7 steps)."""

    def __init__(self) -> None:
        self.sums: dict[int, tuple] = {}


class TTTCache(list):
    """The per-step (k, v) cache of one TTT unroll (layers.attend appends to it), with its KeyGrads and,
    for packed rows, where the documents are: `segments` ((row, start, end), for the causal kernels) and
    `doc_ids` ([B, T], for the eager and flex masks); both None for one sample per row (ttt.unroll sets them)."""

    def __init__(self) -> None:
        super().__init__()
        self.key_grads = KeyGrads()
        self.segments: tuple[tuple[int, int, int], ...] | None = None
        self.doc_ids: torch.Tensor | None = None


def _docs_fwd(q, k, v, scale: float, backend: str, segments):
    """The causal kernel once per document of packed rows: (out in q's layout, lse [B,h,T] fp32, the
    per-document (raw lse, aux) its backward needs)."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    parts = []
    for r, s, e in segments:
        sl = (slice(r, r + 1), slice(None), slice(s, e))
        o, lse_raw, aux = _causal_fwd(q[sl], k[sl], v[sl], scale, backend)
        out[sl] = o
        lse[sl] = _rows(lse_raw, (1, q.shape[1], e - s))
        parts.append((lse_raw, aux))
    return out, lse, parts


def _global_lse(lse_raw: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The kernel's raw log-sum-exp with the merged (global) L written over its rows [B, h, T]."""
    b, h, t = lse.shape
    g = lse_raw.clone(memory_format=torch.contiguous_format)
    g.reshape(b, h, -1)[..., :t] = lse
    return g


def _docs_bwd(dout, q, k, v, out, lse, merged: bool, parts, segments, scale: float, backend: str):
    """_causal_bwd once per document (the backward of _docs_fwd): dq, dk, dv for the whole rows."""
    dq = dk = dv = None
    for (r, s, e), (lse_raw, aux) in zip(segments, parts, strict=True):
        sl = (slice(r, r + 1), slice(None), slice(s, e))
        lse_g = _global_lse(lse_raw, lse[sl]) if merged else lse_raw
        g = _causal_bwd(dout[sl], q[sl], k[sl], v[sl], out[sl], lse_g, aux, scale, backend)
        if dq is None:  # in the kernel's dtype (the reference's is fp32), q's and k's layouts
            dq, dk, dv = (torch.empty_like(x, dtype=gx.dtype) for x, gx in zip((q, k, v), g, strict=True))
        dq[sl], dk[sl], dv[sl] = g
    return dq, dk, dv


class _TTTFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, scale, backend, key_grads, segments, k0, v0, *rest):
        h, d = q.shape[1], q.shape[3]
        kv, dv = k0.shape[1], v0.shape[-1]
        rep = 1 if backend in READS_GQA else h // kv
        k0e = k0.repeat_interleave(rep, 1) if rep > 1 else k0
        v0e = v0.repeat_interleave(rep, 1) if rep > 1 else v0
        v0e = F.pad(v0e, (0, d - dv)) if dv < d else v0e  # one head dim for the kernel
        if segments is None:
            out_c, lse_raw, aux = _causal_fwd(q, k0e, v0e, scale, backend)
            lse = _rows(lse_raw, q.shape[:3])
        else:  # packed rows: per document; aux holds each one's raw lse and kernel aux
            out_c, lse, aux = _docs_fwd(q, k0e, v0e, scale, backend, segments)
            lse_raw = None
        out_k = out_c  # the output in the kernel's layout, value dims padded with zeros
        if rest:  # step 0 has no diagonal keys: the causal output is the answer
            # written in the kernel's layout (cuDNN's and FlashAttention's are [B, T, h, d] in memory): the
            # caller's transpose to [B, T, h*d] is then a view, and backward hands the kernel its own output
            out_k, lse = ttt_merge.merge(q, out_c, lse, rest[0::2], rest[1::2], scale)
        ctx.save_for_backward(q, k0e, v0e, out_k, lse, lse_raw, *rest)
        ctx.aux, ctx.scale, ctx.backend, ctx.kv, ctx.segments = aux, scale, backend, kv, segments
        ctx.key_grads = key_grads
        return out_k[..., :dv]

    @staticmethod
    def backward(ctx, dout):
        q, k0e, v0e, out_k, lse, lse_raw, *rest = ctx.saved_tensors
        n, scale = len(rest) // 2, ctx.scale
        b, h, t, d = q.shape
        dv_dim = dout.shape[-1]
        # the causal block against the global softmax: the merged output and L, dO in the layout of O
        # (cuDNN wants it so; the caller's reshape gives it so already, then nothing is copied)
        same = dv_dim == d and dout.stride() == out_k.stride()
        dout_k = dout if same else _in_layout(out_k, dout)
        if ctx.segments is not None:
            dq_c, dk0, dv0 = _docs_bwd(
                dout_k, q, k0e, v0e, out_k, lse, bool(n), ctx.aux, ctx.segments, scale, ctx.backend
            )
        else:
            lse_g = _global_lse(lse_raw, lse) if n else lse_raw
            dq_c, dk0, dv0 = _causal_bwd(dout_k, q, k0e, v0e, out_k, lse_g, ctx.aux, scale, ctx.backend)
        drest = []
        if n:
            sums = ctx.key_grads.sums if ctx.key_grads is not None else {}
            held = {j: sums.pop(j) for j in range(1, n + 1) if j in sums}
            grads = ttt_merge.merge_grad(
                q, dout_k[..., :dv_dim], out_k[..., :dv_dim], lse, dq_c, rest[0::2], rest[1::2], scale, held
            )
            for j, pair in enumerate(grads, start=1):
                if ctx.key_grads is not None and j < n:  # keys 1..n-1 wait for their own steps
                    sums[j] = pair
                    drest += [None, None]
                else:  # key n is this step's own: its total (every later step's part added in)
                    drest += list(pair)
        dv0 = dv0[..., :dv_dim]
        if dk0.shape[1] != ctx.kv:  # the kv heads were repeated for the kernel: their gradients summed back
            dk0 = dk0.view(b, ctx.kv, h // ctx.kv, t, d).sum(2)
            dv0 = dv0.reshape(b, ctx.kv, h // ctx.kv, t, dv_dim).sum(2)
        return (dq_c.to(q.dtype), None, None, None, None, dk0.to(q.dtype), dv0.to(q.dtype), *drest)


def ttt_attention(q: torch.Tensor, cache: list, scale: float, backend: str = "flash") -> torch.Tensor:
    """q [B, h, T, d]; cache [(k0, v0), (k1, v1), ...]: the step-0 prefix (T keys, causal) then one key
    per query for each earlier draft step. -> [B, h, T, dv], the TTT-masked attention. backend: "flash"
    (FlashAttention-2), "cudnn" (cuDNN's fused attention) or "reference"; CPU tensors take the reference.
    A TTTCache (one TTT unroll, calls in step order) sums its keys' gradients across steps (KeyGrads);
    a plain list gets every key's gradient from this call alone."""
    if backend not in BACKENDS:
        raise ValueError(f"flash TTT attention backend {backend!r}: allowed {', '.join(BACKENDS)}")
    flat = [x for kv in cache[1:] for x in kv]
    key_grads, segments = (cache.key_grads, cache.segments) if isinstance(cache, TTTCache) else (None, None)
    backend = backend if q.is_cuda else "reference"
    return _TTTFlash.apply(q, scale, backend, key_grads, segments, cache[0][0], cache[0][1], *flat)
