"""The TTT diagonal merge: a step's diagonal keys folded into the causal attention, forward and backward.

flash_ttt.py splits TTT attention into a causal kernel over the prefix and, at step n, n diagonal keys
with one key per query. This module owns the second part, in one pass over all n keys:

- forward: s_j = q . k_j * scale; L = logaddexp(lse_c, s_1, ..., s_n) by an online softmax;
  out = out_c e^(lse_c - L) + sum_j e^(s_j - L) v_j, fp32 inside, written in the causal kernel's
  layout (the value dims zero-padded to q's head dim);
- backward, with the global L and the merged output: D = rowsum(dO . O), per key p = e^(s - L),
  dS = p (dO . v - D); dq_c += sum_j dS k_j * scale (in place, into the causal kernel's dq);
  dk_j = dS q * scale and dv_j = p dO, summed over the key's query heads; the scores are recomputed,
  not saved. A key's gradient may be added into a buffer that already holds the later steps' parts
  (flash_ttt.KeyGrads), so autograd does not add them one pair at a time.

On CUDA both are one Triton kernel each (`merge_fwd`, `merge_bwd`, ttt_merge_kernels.py), compiled once
per dtype and head dim, for every length and every number of keys: the keys reach the kernel as a tuple
of up to `KEYS_PER_LAUNCH` pointers and a runtime count, and more keys take more launches (the online
softmax chains). torch.compile would build one graph per key count (21 per direction at 7 TTT steps: a
100 s first step, docs/training.md). On the CPU the same formulas run in torch (`reference_merge`,
`reference_merge_grad`), which the tests hold to the eager attention's autograd; scripts/bench_train.py
--mode numerics holds the kernels to the fp32 reference on a GPU. Imports torch; ttt_merge_kernels, and
with it triton, only when a CUDA tensor arrives.
"""

from __future__ import annotations

import functools
import logging

import torch

KEYS_PER_LAUNCH = 8
TRITON_MIN = (3, 2)  # tuples as kernel arguments (triton-lang/triton#5220; torch 2.6's triton)
log = logging.getLogger(__name__)


@functools.cache
def kernels_run() -> bool:
    """Whether this host's triton builds the kernels; without it (or older than TRITON_MIN) the merge
    runs the torch path on the GPU too, correct and slower, and says so once."""
    try:
        import triton
    except ImportError:
        log.warning("triton is not installed: the TTT merge runs in plain torch (slower)")
        return False
    version = tuple(int(x) for x in triton.__version__.split(".")[:2] if x.isdigit())
    if version < TRITON_MIN:
        log.warning("triton %s predates %s: the TTT merge runs in plain torch (slower)", triton.__version__,
                    ".".join(map(str, TRITON_MIN)))  # fmt: skip
        return False
    return True


def _bthd_empty(like: torch.Tensor, heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """An empty [B, heads, T, dim] tensor laid out as [B, T, heads, dim]: the projections' layout, so
    the o/k/v projections' backward reads it as [B, T, heads * dim] without a copy."""
    b, _, t, _ = like.shape
    return torch.empty(b, t, heads, dim, dtype=dtype, device=like.device).transpose(1, 2)


def merge(q, out_c, lse_c, keys, vals, scale: float):
    """-> (out [B,h,T,d] in out_c's layout and dtype, value dims beyond dv zero; L [B,h,T] fp32).
    q [B,h,T,d]; out_c the causal output [B,h,T,d] (its first dv dims the values'); lse_c [B,h,T] fp32;
    keys [B,kv,T,d] and vals [B,kv,T,dv], one per diagonal key."""
    if not (q.is_cuda and kernels_run()):
        return reference_merge(q, out_c, lse_c, keys, vals, scale)
    return kernel_merge(q, out_c, lse_c, keys, vals, scale)


def kernel_merge(q, out_c, lse_c, keys, vals, scale: float):
    """`merge` by the Triton kernel, KEYS_PER_LAUNCH keys a launch."""
    out = torch.empty_like(out_c)
    big = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    src, src_lse = out_c, lse_c
    for i in range(0, len(keys), KEYS_PER_LAUNCH):
        _launch_fwd(
            q, src, src_lse, out, big, keys[i : i + KEYS_PER_LAUNCH], vals[i : i + KEYS_PER_LAUNCH], scale
        )
        src, src_lse = out, big  # the next launch folds its keys into this one's result, in place
    return out, big


def merge_grad(q, dout, out, big, dq_c, keys, vals, scale: float, held: dict[int, tuple]) -> list:
    """Adds the keys' part of dq into dq_c (in place) and returns [(dk_j, dv_j)] for each key, in the
    keys' dtype, each plus held[j] (the later steps' parts for key j) where held has it. dout, out
    [B,h,T,dv]; big the global log-sum-exp [B,h,T]; the rest as `merge`."""
    if not (q.is_cuda and kernels_run()):
        return reference_merge_grad(q, dout, out, big, dq_c, keys, vals, scale, held)
    return kernel_merge_grad(q, dout, out, big, dq_c, keys, vals, scale, held)


def kernel_merge_grad(q, dout, out, big, dq_c, keys, vals, scale: float, held: dict[int, tuple]) -> list:
    """`merge_grad` by the Triton kernel."""
    h, kv = q.shape[1], keys[0].shape[1]
    d, dv = keys[0].shape[-1], vals[0].shape[-1]
    grouped = h != kv
    grads = []
    for i in range(len(keys)):
        if grouped:  # per query head in fp32, summed over each key head's group below
            grads.append((_bthd_empty(q, h, d, torch.float32), _bthd_empty(q, h, dv, torch.float32)))
        elif i + 1 in held:
            grads.append(held[i + 1])  # added into in place by the kernel
        else:
            grads.append((_bthd_empty(q, kv, d, keys[i].dtype), _bthd_empty(q, kv, dv, vals[i].dtype)))
    for i in range(0, len(keys), KEYS_PER_LAUNCH):
        part = range(i, min(i + KEYS_PER_LAUNCH, len(keys)))
        adds = [not grouped and j + 1 in held for j in part]
        _launch_bwd(q, dout, out, big, dq_c, [keys[j] for j in part], [vals[j] for j in part],
                    [grads[j] for j in part], adds, scale)  # fmt: skip
    if not grouped:
        return grads
    b, t = q.shape[0], q.shape[2]
    total = []
    for j, (dk, dvj) in enumerate(grads):
        dk = dk.transpose(1, 2).reshape(b, t, kv, h // kv, d).sum(3)
        dvj = dvj.transpose(1, 2).reshape(b, t, kv, h // kv, dv).sum(3)
        if j + 1 in held:
            dk, dvj = dk + held[j + 1][0].transpose(1, 2), dvj + held[j + 1][1].transpose(1, 2)
        total.append((dk.to(keys[j].dtype).transpose(1, 2), dvj.to(vals[j].dtype).transpose(1, 2)))
    return total


def reference_merge(q, out_c, lse_c, keys, vals, scale: float):
    """`merge` in torch, key by key (the CPU's path, and the formulas the kernel follows)."""
    kv, dv = keys[0].shape[1], vals[0].shape[-1]
    acc, big = out_c[..., :dv].float(), lse_c
    for k, v in zip(keys, vals, strict=True):
        s = (_grouped(q, kv).float() * k.float()[:, :, None]).sum(-1).flatten(1, 2) * scale
        new = torch.logaddexp(big, s)
        acc = acc * torch.exp(big - new)[..., None] + torch.exp(s - new)[..., None] * _expand(v.float(), q)
        big = new
    out = torch.zeros_like(out_c)
    out[..., :dv] = acc
    return out, big


def reference_merge_grad(q, dout, out, big, dq_c, keys, vals, scale: float, held: dict[int, tuple]) -> list:
    """`merge_grad` in torch (the CPU's path)."""
    kv = keys[0].shape[1]
    do = dout.float()
    dsum = (do * out.float()).sum(-1)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grads = []
    for j, (k, v) in enumerate(zip(keys, vals, strict=True)):
        s = (_grouped(q, kv).float() * k.float()[:, :, None]).sum(-1).flatten(1, 2) * scale
        p = torch.exp(s - big)
        ds = p * ((do * _expand(v.float(), q)).sum(-1) - dsum)
        dq = dq + ds[..., None] * _expand(k.float(), q) * scale
        dk = _grouped(ds[..., None] * q.float(), kv).sum(2) * scale
        dvj = _grouped(p[..., None] * do, kv).sum(2)
        if j + 1 in held:
            dk, dvj = dk + held[j + 1][0], dvj + held[j + 1][1]
        grads.append((dk.to(k.dtype), dvj.to(v.dtype)))
    dq_c.add_(dq)
    return grads


def _grouped(x: torch.Tensor, kv: int) -> torch.Tensor:
    """[B, h, T, d] -> [B, kv, h // kv, T, d] (a view): query heads grouped by the key head they read."""
    b, h, t, d = x.shape
    return x.view(b, kv, h // kv, t, d)


def _expand(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[B, kv, T, d] -> [B, h, T, d]: each key head repeated for its query heads."""
    rep = q.shape[1] // x.shape[1]
    return x.repeat_interleave(rep, 1) if rep > 1 else x


def _block(d: int) -> tuple[int, int, int]:
    """(head-dim block, rows per program, warps) for a head dim. Timed on an H200 over a 7-step unroll's
    merges, forward and backward (docs/training.md): 16 rows with 4 warps up to 128 (6.2 ms at Kimi 8K,
    2.7 at Llama 2K with GQA; 32 rows and 8 warps 6.5 and 4.2), 16 rows with 8 warps for the MLA
    draft's 192 (11.6 ms; 4 warps 17.9, 64 rows 30.1)."""
    bd = max(16, 1 << (d - 1).bit_length())
    return bd, 16, (4 if bd <= 128 else 8)


def _pad(xs: list, like: torch.Tensor) -> tuple:
    """The kernel's fixed-length pointer tuple: unused slots repeat a real tensor, never read."""
    return tuple(xs) + (like,) * (KEYS_PER_LAUNCH - len(xs))


def _same_strides(xs: list) -> list:
    """The kernel takes one set of strides for all keys (and one for all values): every TTT step builds
    them alike, so this copies only if some caller did not."""
    first = xs[0].stride()
    return [x if x.stride() == first else torch.empty_strided(x.shape, first, dtype=x.dtype, device=x.device).copy_(x) for x in xs]  # fmt: skip


def _launch_fwd(q, src, src_lse, out, big, keys, vals, scale: float) -> None:
    kern = _kernels()[0]
    b, h, t, d = q.shape
    kv, dv = keys[0].shape[1], vals[0].shape[-1]
    keys, vals = _same_strides(keys), _same_strides(vals)
    bd, bt, warps = _block(d)
    kern[(_cdiv(t, bt), b * h)](
        q, *q.stride(), src, *src.stride(), out, *out.stride(), src_lse, *src_lse.stride(), big,
        _pad(keys, keys[0]), _pad(vals, vals[0]), *keys[0].stride(), *vals[0].stride(),
        len(keys), t, h, h // kv, scale, D=d, DV=dv, BD=bd, BT=bt, NMAX=KEYS_PER_LAUNCH, num_warps=warps,
    )  # fmt: skip


def _launch_bwd(q, dout, out, big, dq_c, keys, vals, grads, adds, scale: float) -> None:
    kern = _kernels()[1]
    b, h, t, d = q.shape
    kv, dv = keys[0].shape[1], vals[0].shape[-1]
    keys, vals = _same_strides(keys), _same_strides(vals)
    dks, dvs = [g[0] for g in grads], [g[1] for g in grads]
    assert all(x.stride() == dks[0].stride() for x in dks) and all(x.stride() == dvs[0].stride() for x in dvs)
    flags = sum(1 << i for i, a in enumerate(adds) if a)
    bd, bt, warps = _block(d)
    kern[(_cdiv(t, bt), b * h)](
        q, *q.stride(), dout, *dout.stride(), out, *out.stride(), big, dq_c, *dq_c.stride(),
        _pad(keys, keys[0]), _pad(vals, vals[0]), *keys[0].stride(), *vals[0].stride(),
        _pad(dks, dks[0]), _pad(dvs, dvs[0]), *dks[0].stride(), *dvs[0].stride(), flags,
        len(keys), t, h, h // kv, scale, D=d, DV=dv, BD=bd, BT=bt, NMAX=KEYS_PER_LAUNCH, num_warps=warps,
    )  # fmt: skip


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _kernels():
    """The two Triton kernels (ttt_merge_kernels.py), imported on first use so that the CPU (tests, CI)
    never imports triton."""
    from regen_service.train import ttt_merge_kernels

    return ttt_merge_kernels.merge_fwd, ttt_merge_kernels.merge_bwd
