"""AdamW on the fp32 masters that also writes the bf16 parameters: one pass over memory per step, not two.

The update is memory-bound. torch's fused AdamW (`_fused_adamw_`) reads each master, gradient and moment
and writes them back, and with a `grad_scale` (the clip, trainer.py) it writes the unscaled gradient back
too; the trainer then read every master again to write its bf16 copy (`MasterWeights.to_params`). At
Kimi-K2.5 draft shapes (1.14B trainable entries) that was ~41 GB a step. `MasterAdamW.step` makes the
same update in one Triton kernel per parameter that reads master, gradient and moments once and writes
master, moments and the bf16 parameter: 30 bytes an entry, ~34 GB (8.5 ms against 12.8 on an H200).

The math is `_fused_adamw_`'s (aten/src/ATen/native/cuda/fused_adam_utils.cuh, read at pytorch/pytorch
01e5d8d), in fp32: g = grad / grad_scale; p -= lr * wd * p; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps). On an H200 the masters stayed within 2.2e-8
of torch's fused AdamW after 3 steps. It is a `torch.optim.AdamW`: the same param groups, the same
state (`step` a float32 tensor on the parameter's device, `exp_avg`, `exp_avg_sq`), so its `state_dict`
loads into either and the LR schedulers drive it. Each parameter's step count lives on the host too (read
once from the state after a load), so a step never waits on the GPU. CPU tensors, and anything the kernel
does not take (amsgrad, maximize, a non-fp32 master or gradient), run torch's own step and then
`MasterWeights.to_params`.
Imports torch; triton only on CUDA.
"""

from __future__ import annotations

import functools
import math

import torch

from regen_service.train.optim import MasterWeights

# entries per program, warps: 1024 to 8192 entries ran within 3% of each other on an H200 (8.44-8.69 ms)
BLOCK = 2048
NUM_WARPS = 8


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_kernel(
        p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, scale_ptr, n, lr, lr_wd, beta1, beta2, step_size,
        bc2_sqrt, eps, HAS_SCALE: tl.constexpr, HAS_OUT: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        if HAS_SCALE:
            g = g / tl.load(scale_ptr)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        p = p - lr_wd * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - step_size * m / (tl.sqrt_rn(v) / bc2_sqrt + eps)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if HAS_OUT:
            tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)

    return adamw_kernel


def adamw_(p, g, m, v, out, grad_scale, *, lr, weight_decay, beta1, beta2, eps, step: int) -> None:
    """One AdamW update of fp32 p, m, v (contiguous, CUDA) from g (/ grad_scale, a 1-entry fp32 tensor,
    or None); out (or None): p's copy in the parameter's dtype, written from the updated fp32 values."""
    n = p.numel()
    bc1 = 1.0 - beta1**step
    bc2 = 1.0 - beta2**step
    _kernel()[(math.ceil(n / BLOCK),)](
        p, g, m, v, out if out is not None else p, grad_scale if grad_scale is not None else p, n,
        lr, lr * weight_decay, beta1, beta2, lr / bc1, math.sqrt(bc2), eps,
        HAS_SCALE=grad_scale is not None, HAS_OUT=out is not None, BLOCK=BLOCK, num_warps=NUM_WARPS,
    )  # fmt: skip


class MasterAdamW(torch.optim.AdamW):
    """torch's AdamW over a MasterWeights' fp32 masters (optim.py) whose bf16 parameters the step also
    writes. `grad_scale` (a 1-entry tensor, or None), set before `step` as on torch's fused AdamW: each
    gradient is divided by it as it is read."""

    def __init__(self, weights: MasterWeights, **kw):
        super().__init__(weights.masters, **kw)
        self._weights = weights
        # id(master) -> the parameter the kernel writes, where the master is a copy (not its own parameter)
        self._shadow = {id(m): p for m, p in zip(weights.masters, weights.params, strict=True) if m is not p}
        self._host_steps: dict[int, int] = {}  # id(master) -> its step count, as its state holds it
        self.grad_scale: torch.Tensor | None = None

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._host_steps.clear()  # read again from the loaded state, once per parameter

    @staticmethod
    def _takes(group: dict, p: torch.Tensor) -> bool:
        return (
            p.is_cuda and p.dtype == torch.float32 and p.is_contiguous() and p.grad.dtype == torch.float32
            and p.grad.is_contiguous() and not group["amsgrad"] and not group["maximize"]
        )  # fmt: skip

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:  # the trainer never passes one; an LBFGS-style caller would lose it silently
            raise ValueError("MasterAdamW.step takes no closure: compute the loss and backward before step()")
        todo = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not todo or not all(self._takes(g, p) for g, p in todo):
            self._host_steps.clear()
            super().step()  # torch's own AdamW, then the masters' copies
            self._weights.to_params()
            return None
        steps = []
        for group, p in todo:
            st = self.state[p]
            if "step" not in st:  # as torch's fused AdamW lays its state out
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if id(p) not in self._host_steps:  # a sync once per parameter and load, not per step
                self._host_steps[id(p)] = int(st["step"].item())
            self._host_steps[id(p)] += 1
            steps.append(st["step"])
            b1, b2 = group["betas"]
            adamw_(
                p, p.grad, st["exp_avg"], st["exp_avg_sq"], self._shadow.get(id(p)), self.grad_scale,
                lr=float(group["lr"]), weight_decay=group["weight_decay"], beta1=b1, beta2=b2,
                eps=group["eps"], step=self._host_steps[id(p)],
            )  # fmt: skip
        torch._foreach_add_(steps, 1.0)
        return None
