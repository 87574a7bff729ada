"""The TTT diagonal merge's two Triton kernels, `merge_fwd` and `merge_bwd` (ttt_merge.py launches them,
owns their formulas' torch reference and says what they compute).

A module of its own so that only a CUDA host with triton imports it (ttt_merge._kernels, on the first
CUDA tensor): the CPU, CI among them, never does. The kernels' shared prologue is the `_tile` helper,
a module-level function because triton before 3.4 resolves a kernel's callees from its module's globals
only, never from a closure (triton/compiler/code_generator.py, 3.2.0 and 3.3.1: `gscope =
fn.__globals__`), and ttt_merge.TRITON_MIN is 3.2.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(
    Q, sq_b, sq_h, sq_t, sq_d, T, H, REP,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """A program's rows: its (batch x head) index bh, b, h, the key head g, the positions t and head-dim
    lanes d, the masks (rows in range; and q's, and the values', dims in range) and its q tile in fp32."""
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.arange(0, BD)
    mt = t < T
    mq = mt[:, None] & (d < D)[None, :]
    mv = mt[:, None] & (d < DV)[None, :]
    q = tl.load(Q + b * sq_b + h * sq_h + t[:, None] * sq_t + d[None, :] * sq_d, mask=mq, other=0.0)
    return bh, b, h, h // REP, t, d, mt, mq, mv, q.to(tl.float32)


# n and T change from call to call: not specialised on (triton would compile again for n == 1, and
# for T a multiple of 16 or not), so each kernel compiles once per dtype and head dim
@triton.jit(do_not_specialize=["n", "T"])
def merge_fwd(
    Q, sq_b, sq_h, sq_t, sq_d, OC, soc_b, soc_h, soc_t, soc_d, OUT, so_b, so_h, so_t, so_d,
    LC, slc_b, slc_h, slc_t, LO, K, V, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    n, T, H, REP, scale,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, NMAX: tl.constexpr,
):  # fmt: skip
    bh, b, h, g, t, d, mt, mq, mv, q = _tile(Q, sq_b, sq_h, sq_t, sq_d, T, H, REP, D=D, DV=DV, BD=BD, BT=BT)
    src = OC + b * soc_b + h * soc_h + t[:, None] * soc_t + d[None, :] * soc_d
    acc = tl.load(src, mask=mv, other=0.0).to(tl.float32)
    big = tl.load(LC + b * slc_b + h * slc_h + t * slc_t, mask=mt, other=0.0).to(tl.float32)
    koff = b * sk_b + g * sk_h + t[:, None] * sk_t + d[None, :] * sk_d
    voff = b * sv_b + g * sv_h + t[:, None] * sv_t + d[None, :] * sv_d
    for j in tl.static_range(NMAX):
        if j < n:
            k = tl.load(K[j] + koff, mask=mq, other=0.0).to(tl.float32)
            s = tl.sum(q * k, 1) * scale
            top = tl.maximum(big, s)
            new = top + tl.log(tl.exp(big - top) + tl.exp(s - top))
            v = tl.load(V[j] + voff, mask=mv, other=0.0).to(tl.float32)
            acc = acc * tl.exp(big - new)[:, None] + tl.exp(s - new)[:, None] * v
            big = new
    dst = OUT + b * so_b + h * so_h + t[:, None] * so_t + d[None, :] * so_d
    tl.store(dst, acc.to(OUT.dtype.element_ty), mask=mq)  # acc is 0 past DV: the padding
    tl.store(LO + bh * T + t, big, mask=mt)


@triton.jit(do_not_specialize=["n", "T"])
def merge_bwd(
    Q, sq_b, sq_h, sq_t, sq_d, DO, sdo_b, sdo_h, sdo_t, sdo_d, OUT, so_b, so_h, so_t, so_d,
    L, DQ, sdq_b, sdq_h, sdq_t, sdq_d,
    K, V, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    DK, DVS, sdk_b, sdk_h, sdk_t, sdk_d, sdv_b, sdv_h, sdv_t, sdv_d, adds,
    n, T, H, REP, scale,
    D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, NMAX: tl.constexpr,
):  # fmt: skip
    bh, b, h, g, t, d, mt, mq, mv, q = _tile(Q, sq_b, sq_h, sq_t, sq_d, T, H, REP, D=D, DV=DV, BD=BD, BT=BT)
    do = tl.load(DO + b * sdo_b + h * sdo_h + t[:, None] * sdo_t + d[None, :] * sdo_d, mask=mv, other=0.0)
    do = do.to(tl.float32)
    o = tl.load(OUT + b * so_b + h * so_h + t[:, None] * so_t + d[None, :] * so_d, mask=mv, other=0.0)
    dsum = tl.sum(do * o.to(tl.float32), 1)
    big = tl.load(L + bh * T + t, mask=mt, other=0.0)
    dq = tl.zeros([BT, BD], dtype=tl.float32)
    koff = b * sk_b + g * sk_h + t[:, None] * sk_t + d[None, :] * sk_d
    voff = b * sv_b + g * sv_h + t[:, None] * sv_t + d[None, :] * sv_d
    # the outputs' head is the query head: with REP > 1 they are per-query-head (summed by the caller)
    dkoff = b * sdk_b + h * sdk_h + t[:, None] * sdk_t + d[None, :] * sdk_d
    dvoff = b * sdv_b + h * sdv_h + t[:, None] * sdv_t + d[None, :] * sdv_d
    for j in tl.static_range(NMAX):
        if j < n:
            k = tl.load(K[j] + koff, mask=mq, other=0.0).to(tl.float32)
            v = tl.load(V[j] + voff, mask=mv, other=0.0).to(tl.float32)
            p = tl.exp(tl.sum(q * k, 1) * scale - big)
            ds = p * (tl.sum(do * v, 1) - dsum)
            dq += ds[:, None] * k
            dk = ds[:, None] * q * scale
            dv = p[:, None] * do
            add = ((adds >> j) & 1) != 0
            dk += tl.load(DK[j] + dkoff, mask=mq & add, other=0.0).to(tl.float32)
            dv += tl.load(DVS[j] + dvoff, mask=mv & add, other=0.0).to(tl.float32)
            tl.store(DK[j] + dkoff, dk.to(DK[j].dtype.element_ty), mask=mq)
            tl.store(DVS[j] + dvoff, dv.to(DVS[j].dtype.element_ty), mask=mv)
    dst = DQ + b * sdq_b + h * sdq_h + t[:, None] * sdq_t + d[None, :] * sdq_d
    dq = tl.load(dst, mask=mq, other=0.0).to(tl.float32) + dq * scale
    tl.store(dst, dq.to(DQ.dtype.element_ty), mask=mq)
