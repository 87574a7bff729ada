"""Where a training step's GPU time goes: a few steps under torch.profiler, kernels summed by kind.

`profile_steps(step, n, path)` runs `step` n times under the profiler (CPU and CUDA activity, after the
caller's warm-up), writes the per-kernel table (self device time, sorted) to `path`, and returns a
summary per step: the wall time, the GPU's busy time (the sum of every kernel's time; wall minus busy
is launch gaps and host work), and the time per kind of kernel:
- `gemm`: cuBLAS / CUTLASS matrix products (nvjet, sm90_xmma, cutlass, gemm);
- `attention`: FlashAttention-2 (pytorch_flash) and cuDNN's fused attention (sdpa, fmha), both ways;
- `flex`: flex attention's Triton templates, forward and backward;
- `triton`: inductor's fused elementwise and reduction kernels (norms, rotary, SwiGLU, the loss math);
- `optimizer`: the fused AdamW and the grad-norm's multi-tensor kernels;
- `copy`: copies, concatenations, casts and fills (aten's elementwise and copy kernels);
- `other`: the rest, top names listed.
The kinds are read off kernel names as the CUDA libraries of torch 2.11 name them; a name no rule knows
lands in `other` with its time, so nothing is dropped. Imports torch.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

KINDS = (
    ("attention", ("pytorch_flash", "flash_fwd", "flash_bwd", "sdpa", "fmha", "cudnn")),
    ("flex", ("flex_attention", "flex_decoding", "triton_tem_fused")),
    ("gemm", ("nvjet", "gemm", "xmma", "cutlass", "sm90_", "cublas")),
    ("optimizer", ("adam", "multi_tensor", "fused_adam", "l2norm", "foreach")),
    ("triton", ("triton_",)),
    ("copy", ("copy", "cat", "elementwise", "fill", "memcpy", "memset", "index", "gather", "scatter")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def profile_steps(step, n: int, path: Path | None) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_flops=True
    ) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / n
    per_kind: dict[str, float] = {}
    other: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
        kernels[e.name] = kernels.get(e.name, 0.0) + us
        k = kind_of(e.name)
        per_kind[k] = per_kind.get(k, 0.0) + us
        if k == "other":
            other[e.name] = other.get(e.name, 0.0) + us
    busy = sum(per_kind.values()) / n / 1e3
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = sorted(kernels.items(), key=lambda kv: -kv[1])
        lines = [f"wall_ms_per_step {wall * 1e3:.2f}  gpu_busy_ms_per_step {busy:.2f}  steps {n}", ""]
        lines += [f"{us / n / 1e3:10.3f} ms  {kind_of(name):9s} {name[:160]}" for name, us in rows]
        lines += ["", "ops by input shape (self device time, the matrix products' TFLOP/s):", ""]
        lines += op_rows(prof, n)
        lines += ["", prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=60)]
        path.write_text("\n".join(lines))
    gemm = [r for r in op_table(prof, n) if r["tflop"]]
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return {
        "wall_ms": round(wall * 1e3, 2),
        "gpu_busy_ms": round(busy, 2),
        "ms_by_kind": {k: round(v / n / 1e3, 2) for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])},
        "other_top": {
            k[:80]: round(v / n / 1e3, 2) for k, v in sorted(other.items(), key=lambda kv: -kv[1])[:6]
        },
        "top_kernels": [[kind_of(k), k[:90], round(v / n / 1e3, 2)] for k, v in top],
        "matmul_ms": round(sum(r["ms"] for r in gemm), 2),
        "matmul_tflop": round(sum(r["tflop"] for r in gemm), 2),
    }


def op_table(prof, n: int) -> list[dict]:
    """Per (op, input shapes), per step: self device ms, calls, TFLOP (matrix products: the profiler's
    estimate) and TFLOP/s; sorted by time."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True):
        ms = getattr(e, "self_device_time_total", 0.0) / n / 1e3
        if ms <= 0.005:
            continue
        tflop = (e.flops or 0) / n / 1e12
        rows.append({"op": e.key, "shapes": str(e.input_shapes)[:150], "ms": ms, "calls": e.count / n,
                     "tflop": tflop, "tflops": tflop / ms * 1e3 if tflop else 0.0})  # fmt: skip
    return sorted(rows, key=lambda r: -r["ms"])


def op_rows(prof, n: int) -> list[str]:
    return [f"{r['ms']:9.3f} ms {r['calls']:5.1f}x {r['tflops']:6.0f} TF/s  {r['op'][:40]:40s} {r['shapes']}"
            for r in op_table(prof, n)[:120]]  # fmt: skip
