"""Micro-benchmark: the causal half of the TTT attention per kernel, at the Kimi-K2.5 draft's heads.

cuDNN's fused attention as flash_ttt ran it (grouped kv heads repeated to the query heads) and with the
grouped keys handed over as they are, then, with `--fa4`, FlashAttention-4 (flash-attn-4's CuTe DSL
kernels, train/fa4.py's calls) with grouped keys: forward and backward ms (mean of 10 after 2 warm-ups),
TFLOP/s (4*T^2/2*h*d forward, 2.5x that backward), FA4's first-call compile seconds and its outputs and
gradients against cuDNN's (max difference over the largest value). One JSON line per length. B 1, 56
query heads, 8 kv heads, head dim 128, bf16. On a GPU host:
    PYTHONPATH=. python3 scripts/bench_attention.py 8192,16384 [--fa4]
docs/training.md (issue 21, ninth session) quotes its figures.
"""

import json
import sys
import time

import torch

dev = "cuda"
B, H, KV, D = 1, 56, 8, 128
scale = D**-0.5
out_recs = []


def bench(fn, n=10):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-6)).item()


fa4 = None
if "--fa4" in sys.argv:
    t0 = time.time()
    from flash_attn.cute import interface as fa4

    print("fa4 import s", round(time.time() - t0, 1), flush=True)


def one_length(T: int, fa4) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, T, KV, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, T, KV, D, device=dev, dtype=torch.bfloat16, generator=g)
    dout = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16, generator=g)
    fl = 4 * T * T / 2 * H * D * B
    rec = {"T": T}
    qh, doh = q.transpose(1, 2), dout.transpose(1, 2)
    ke = k.transpose(1, 2).repeat_interleave(H // KV, 1)
    ve = v.transpose(1, 2).repeat_interleave(H // KV, 1)
    cud = torch.ops.aten._scaled_dot_product_cudnn_attention
    cub = torch.ops.aten._scaled_dot_product_cudnn_attention_backward
    r = cud(qh, ke, ve, None, True, 0.0, True, False, scale=scale)
    o_c, lse_c, aux = r[0], r[1], r[2:8]
    cq, ck, mq, mk, seed, off = aux

    def cb():
        return cub(doh, qh, ke, ve, o_c, lse_c, seed, off, None, cq, ck, mq, mk, 0.0, True, scale=scale)

    rec["cudnn_fwd_ms"] = bench(lambda: cud(qh, ke, ve, None, True, 0.0, True, False, scale=scale))
    rec["cudnn_bwd_ms"] = bench(cb)
    dq_c, dk_c, dv_c = cb()[:3]
    dk_c = dk_c.reshape(B, KV, H // KV, T, D).sum(2)
    dv_c = dv_c.reshape(B, KV, H // KV, T, D).sum(2)
    try:
        k8, v8 = k.transpose(1, 2), v.transpose(1, 2)
        r8 = cud(qh, k8, v8, None, True, 0.0, True, False, scale=scale)
        rec["cudnn_gqa_fwd_ms"] = bench(lambda: cud(qh, k8, v8, None, True, 0.0, True, False, scale=scale))
        a8 = r8[2:8]
        rec["cudnn_gqa_bwd_ms"] = bench(
            lambda: cub(doh, qh, k8, v8, r8[0], r8[1], a8[4], a8[5], None, *a8[:4], 0.0, True, scale=scale)
        )
        g8 = cub(doh, qh, k8, v8, r8[0], r8[1], a8[4], a8[5], None, *a8[:4], 0.0, True, scale=scale)
        rec["cudnn_gqa_dk_rel"] = rel(g8[1], dk_c)
    except RuntimeError as ex:  # this cuDNN may refuse grouped keys: recorded, the rest still runs
        rec["cudnn_gqa_error"] = repr(ex)[:300]
    if fa4 is not None:
        try:
            t0 = time.time()
            o4, lse4 = fa4._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True)[:2]
            torch.cuda.synchronize()
            rec["fa4_fwd_first_s"] = round(time.time() - t0, 2)
            t0 = time.time()
            dq4, dk4, dv4 = fa4._flash_attn_bwd(q, k, v, o4, dout, lse4, scale, True)[:3]
            torch.cuda.synchronize()
            rec["fa4_bwd_first_s"] = round(time.time() - t0, 2)
            rec["fa4_fwd_ms"] = bench(
                lambda: fa4._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, return_lse=True)
            )
            rec["fa4_bwd_ms"] = bench(lambda: fa4._flash_attn_bwd(q, k, v, o4, dout, lse4, scale, True))
            rec["lse_shape"] = list(lse4.shape)
            rec["rel_out"] = rel(o4.transpose(1, 2), o_c)
            rec["rel_lse"] = rel(lse4, lse_c.reshape(B, H, -1)[..., :T])
            rec["rel_dq"] = rel(dq4.transpose(1, 2), dq_c)
            rec["rel_dk"] = rel(dk4.transpose(1, 2), dk_c)
            rec["rel_dv"] = rel(dv4.transpose(1, 2), dv_c)
            # merged-output backward (the trainer's call): out and lse handed in, not its own
            o_half = (o4.float() * 0.5).to(o4.dtype)
            _ = fa4._flash_attn_bwd(q, k, v, o_half, dout, lse4 + 0.3, scale, True)
        except Exception as ex:  # a kernel's failure is the result: recorded, printed
            import traceback

            traceback.print_exc()
            rec["fa4_error"] = repr(ex)[:400]
    for kname in list(rec):
        if kname.endswith("_ms"):
            base = kname[:-3]
            f = fl * (2.5 if "bwd" in kname else 1.0)
            rec[base + "_tflops"] = round(f / (rec[kname] / 1e3) / 1e12, 1)
            rec[kname] = round(rec[kname], 3)
    return rec


for T in [int(x) for x in sys.argv[1].split(",")]:
    print(json.dumps(one_length(T, fa4)), flush=True)
