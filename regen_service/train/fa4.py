"""FlashAttention-4 (the `flash-attn-4` package, CuTe DSL) as the causal half of the TTT attention.

flash_ttt.py splits each TTT step's attention into a causal flash attention over the prefix and the
diagonal keys merged by log-sum-exp; this module is one of the kernels it can call for the causal
half, where the optional package is installed (`pip install 'regen[fa4]'`) and the GPU is a Hopper
or later. What it leaves to flash_ttt: the merge, the global log-sum-exp handed back to the backward,
the value-dim padding.

Why it is worth a backend: on one H200, isolated (scripts/bench_attention.py: 56 query heads of 128 on
8 kv heads, causal, bf16), the FA4 of flash-attn-4 4.0.0b40 ran the forward in 1.35 ms against cuDNN
9.19's 1.51 at 8K tokens and 5.88 against 6.23 at 16K, the backward in 4.16 against 4.52 and 17.42
against 17.84; in the trainer, at the Kimi-K2.5 draft's shapes, the whole 8K step ran 0.73% faster
(docs/training.md, issue 21's ninth session). It also reads grouped keys (GQA) as they are, so nothing
repeats the kv heads for it and its dK/dV come back per kv head.

The calls are the package's own `flash_attn.cute.interface._flash_attn_fwd` / `_flash_attn_bwd`
(read at 4.0.0b40): q, k, v, out and dout in [B, T, h, d] memory, which is the layout the trainer's
projections and rotary already write (q is handed over as [B, h, T, d] views of it, so nothing is
copied); the log-sum-exp [B, h, T] fp32, natural log. Its kernels compile on first use (about 3 s
each way on the H200) and once per process after that, whatever the sequence length.
Imports torch only; the package is imported on first use (about 7 s).
"""

from __future__ import annotations

import functools
import importlib.util

import torch


def installed() -> bool:
    """The package is there (found, not imported: importing it costs seconds)."""
    try:  # finding the subpackage imports `flash_attn` itself, which FlashAttention-2 may own and break
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:
        return False


# the package's kernels are built for sm90 and later
MIN_CAPABILITY = (9, 0)


@functools.cache
def _interface():
    from flash_attn.cute import interface

    return interface


def _bshd(x: torch.Tensor) -> torch.Tensor:
    """[B, h, T, d] -> [B, T, h, d] with unit stride in d: a view when x already is one (the trainer's)."""
    return x.transpose(1, 2).contiguous()


def forward(q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention: q [B, h, T, d], k/v [B, kv, T, d] (kv divides h) -> (out [B, h, T, d] in
    [B, T, h, d] memory, lse [B, h, T] fp32)."""
    out, lse = _interface()._flash_attn_fwd(
        _bshd(q), _bshd(k), _bshd(v), softmax_scale=scale, causal=True, return_lse=True
    )[:2]
    return out.transpose(1, 2), lse


def backward(dout, q, k, v, out, lse, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq [B, h, T, d], dk and dv [B, kv, T, d] of the causal attention, for the given out and lse (the
    merged ones: see flash_ttt's backward)."""
    dq, dk, dv = _interface()._flash_attn_bwd(
        _bshd(q), _bshd(k), _bshd(v), _bshd(out), _bshd(dout), lse, scale, True
    )[:3]
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
