"""How the draft's hot functions are compiled: one owner for every torch.compile in the trainer.

The trainer compiles a few small functions on CUDA (the RMSNorm, the rotary, the SwiGLU, the layer
input's scaled concatenation, flex attention and its block masks) and leaves the matmuls to cuBLAS,
the causal attention to cuDNN or FlashAttention, and the TTT diagonal merge and the head loss's chunk
math to their own Triton kernels (ttt_merge.py: one build for every number of keys, where a compiled
graph would be one per number; loss_kernel.py).
Each is compiled through `compiled(fn)`, so how they are compiled is chosen in one place:

- `dynamic="auto"` (torch's `dynamic=None`): the first call compiles for its exact shapes; the first
  call at another sequence length compiles again with that dimension symbolic ("automatic dynamic").
  A run's first step at its second length pays every function's compile twice, forward and backward;
  the memory fit check (memory.py), which steps at 512 and 1024 tokens before the first batch, pays
  both before training starts.
- `dynamic="lengths"` (the default): the sequence dimension is symbolic from the first call
  (`mark_lengths` marks it on each input, the hidden and head dimensions stay static), so each
  function compiles once forward and once backward whatever the lengths; the fixed-shape kernels the
  first policy would build for one length are never built. The two give the same numbers; what
  they cost in compile time and step time is scripts/bench_train.py's to measure.

`set_dynamic` is called once at start (the trainer does, from its config) before anything is compiled:
functions already compiled keep the policy they were compiled under. Off CUDA nothing is compiled
(`fused_on` returns the plain function: the CPU tests need no compiler). Imports torch only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

COMPILE_DYNAMIC: tuple[str, ...] = ("auto", "lengths")
_policy: dict[str, str] = {"dynamic": "lengths"}


def set_dynamic(mode: str) -> None:
    if mode not in COMPILE_DYNAMIC:
        raise ValueError(f"compile dynamic {mode!r}: allowed {', '.join(COMPILE_DYNAMIC)}")
    _policy["dynamic"] = mode


@functools.cache
def compiled(fn: Callable, all_dynamic: bool = False) -> Callable:
    """fn under torch.compile (once per function and process). all_dynamic: under "lengths", every size
    symbolic from the first call (torch's dynamic=True), for functions whose lengths also arrive as
    Python ints (flex attention's BlockMask carries its sequence lengths, the TTT mask_mod closes over
    T) that no tensor mark reaches; dynamo still specialises the head dims the kernel needs constant."""
    return torch.compile(fn, dynamic=True if all_dynamic and _policy["dynamic"] == "lengths" else None)


def fused_on(x: torch.Tensor, fn: Callable) -> Callable:
    """fn compiled (fused elementwise kernels) on CUDA; plain on the CPU, where tests need no compiler."""
    return compiled(fn) if x.is_cuda else fn


def mark_lengths(*dims: tuple[torch.Tensor | None, int]) -> None:
    """Under the "lengths" policy, mark each (tensor, dim) symbolic before a compiled call sees it, so
    the first compile is the one every length uses. maybe_mark_dynamic: dynamo may still specialise a
    dim that the graph needs concrete, rather than fail."""
    if _policy["dynamic"] != "lengths":
        return
    for t, d in dims:
        if t is not None and t.is_cuda:
            torch._dynamo.maybe_mark_dynamic(t, d % t.dim())
