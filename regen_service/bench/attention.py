"""Micro-benchmark of the TTT attention's causal half per kernel: whole rows, and packed rows' documents.

The kernels are flash_ttt's own calls (`_causal_fwd`/`_causal_bwd` for a whole row, `_docs_fwd`/`_docs_bwd`
for packed rows, one call per document), with the kv heads repeated exactly where flash_ttt repeats them
(every backend but FlashAttention-4, READS_GQA). Per backend:
- `row`: forward and backward ms over one row of T tokens (mean of `repeats` after 2 warm-ups), TFLOP/s
  (4 T^2/2 h d forward, 2.5x that backward), the first call's seconds (a compile or a graph build);
- `docs`: the same row as packed documents, their lengths given. `docs_same_ms` repeats one set of lengths
  (whatever a kernel caches per length is warm); `docs_new_ms` moves every document boundary by 8 tokens
  at each repeat, so each call meets lengths it has not seen: what packed training meets, where documents
  come in every length. torch caches a cuDNN graph per (s_q, s_kv, strides) (aten/src/ATen/native/cudnn/
  MHA.cpp), so there the two differ by the graph builds.
- outputs and gradients against the first backend's (max difference over the largest value).
On the CPU only `reference` runs (flash_ttt's torch formulas): what the tests smoke. Imports torch only.
"""

from __future__ import annotations

import time

import torch

from regen_service.train import flash_ttt


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_ms(fn, dev: torch.device, repeats: int = 10, warmup: int = 2) -> float:
    """Mean ms per call after `warmup` calls (CUDA events on a GPU, the wall clock on the CPU)."""
    for i in range(warmup):
        fn(i)
    _sync(dev)
    t0 = time.perf_counter()
    for i in range(repeats):
        fn(warmup + i)
    _sync(dev)
    return (time.perf_counter() - t0) * 1e3 / repeats


def inputs(t: int, heads: int, kv: int, head_dim: int, dev: torch.device, dtype: torch.dtype, seed: int = 0):
    """q, k, v, dout as the trainer holds them: [B, h, T, d] views of [B, T, h, d] memory, B = 1."""
    g = torch.Generator(device=dev).manual_seed(seed)

    def bthd(h):
        return torch.randn(1, t, h, head_dim, device=dev, dtype=dtype, generator=g).transpose(1, 2)

    return bthd(heads), bthd(kv), bthd(kv), bthd(heads)


def _keys(backend: str, q, k, v):
    rep = 1 if backend in flash_ttt.READS_GQA else q.shape[1] // k.shape[1]
    return (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)) if rep > 1 else (k, v)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-6))


def _segments(lengths: list[int], shift: int, t: int) -> tuple[tuple[int, int, int], ...]:
    """Row 0's documents of `lengths`, every inner boundary moved by `shift` tokens, padding to t after."""
    out, s = [], 0
    for i, n in enumerate(lengths):
        e = min(t, s + n + (shift if 0 < i + 1 < len(lengths) else 0))
        if e > s:
            out.append((0, s, e))
        s = e
    if s < t:
        out.append((0, s, t))
    return tuple(out)


def run(backends: list[str], t: int, heads: int, kv: int, head_dim: int, doc_lengths: list[int] | None,
        dev: torch.device, repeats: int = 10) -> dict:  # fmt: skip
    """The JSON record for one row length (module docstring)."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    q, k, v, dout = inputs(t, heads, kv, head_dim, dev, dtype)
    scale = head_dim**-0.5
    flops = 4 * t * t / 2 * heads * head_dim
    rec: dict = {"T": t, "heads": heads, "kv_heads": kv, "head_dim": head_dim, "device": str(dev)}
    first = None
    for be in backends:
        kk, vv = _keys(be, q, k, v)
        t0 = time.perf_counter()
        out, lse_raw, aux = flash_ttt._causal_fwd(q, kk, vv, scale, be)
        _sync(dev)
        rec[f"{be}_fwd_first_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        grads = flash_ttt._causal_bwd(dout, q, kk, vv, out, lse_raw, aux, scale, be)
        _sync(dev)
        rec[f"{be}_bwd_first_s"] = round(time.perf_counter() - t0, 3)
        fwd = time_ms(
            lambda i, kk=kk, vv=vv, be=be: flash_ttt._causal_fwd(q, kk, vv, scale, be), dev, repeats
        )
        bwd = time_ms(
            lambda i, kk=kk, vv=vv, be=be, o=out, lr=lse_raw, a=aux: flash_ttt._causal_bwd(
                dout, q, kk, vv, o, lr, a, scale, be
            ),
            dev,
            repeats,
        )
        rec[f"{be}_fwd_ms"], rec[f"{be}_bwd_ms"] = round(fwd, 3), round(bwd, 3)
        rec[f"{be}_fwd_tflops"] = round(flops / (fwd / 1e3) / 1e12, 1)
        rec[f"{be}_bwd_tflops"] = round(2.5 * flops / (bwd / 1e3) / 1e12, 1)
        mine = (out, *grads)
        if first is None:
            first = (be, mine, kk.shape[1])
        else:
            for name, a, b in zip(("out", "dq", "dk", "dv"), mine, first[1], strict=True):
                if a.shape == b.shape:  # dk/dv per kv head only where both kept the same heads
                    rec[f"{be}_vs_{first[0]}_{name}"] = _rel(a, b)
        if doc_lengths:
            rec[f"{be}_docs_same_ms"] = round(
                _docs_ms(be, q, kk, vv, dout, scale, doc_lengths, dev, repeats, False), 3
            )
            rec[f"{be}_docs_new_ms"] = round(
                _docs_ms(be, q, kk, vv, dout, scale, doc_lengths, dev, repeats, True), 3
            )
    if doc_lengths:
        rec["doc_lengths"] = doc_lengths
    return rec


def _docs_ms(be, q, k, v, dout, scale, lengths, dev, repeats: int, new: bool) -> float:
    """Forward + backward ms of one packed row, one kernel call per document (flash_ttt's packed path)."""

    def step(i):
        segs = _segments(lengths, 8 * i if new else 0, q.shape[2])
        out, lse, parts = flash_ttt._docs_fwd(q, k, v, scale, be, segs)
        flash_ttt._docs_bwd(dout, q, k, v, out, lse, False, parts, segs, scale, be)

    return time_ms(step, dev, repeats)
