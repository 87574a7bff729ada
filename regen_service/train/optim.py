"""bf16 parameters, fp32 master weights: the optimizer sees fp32, the model computes in bf16.

`MasterWeights(params)` keeps an fp32 copy of each bf16 trainable parameter and the fp32 gradients of
all of them in one flat buffer (`grads`, grads.py: the linears and the head loss write their weight
gradients there during backward). `to_masters()` closes the step's gradients (folds in what plain
autograd left in `.grad`) and hands each master its fp32 view of the buffer as `.grad`, with no copy,
before clipping and the AdamW step; `to_params()` writes the updated copies back in bf16 (on CUDA the
optimizer, adamw.MasterAdamW, writes them in its own pass and calls this only when it falls back). fp32
parameters (the CPU) are their own masters: nothing is copied. Frozen parameters (the target's
embedding) get no copy and no gradient. The optimizer and its schedule are trainer.py's. Imports torch only.
"""

from __future__ import annotations

import torch

from regen_service.train.grads import GradBuffer


class MasterWeights:
    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = [p for p in params if p.requires_grad]
        self.masters = [
            p if p.dtype == torch.float32 else torch.nn.Parameter(p.detach().float().clone())
            for p in self.params
        ]
        self.grads = GradBuffer(self.params)

    @property
    def copied(self) -> bool:
        return any(m is not p for m, p in zip(self.masters, self.params, strict=True))

    def to_masters(self) -> None:
        self.grads.finish()
        for m, p in zip(self.masters, self.params, strict=True):
            m.grad = p.main_grad  # fp32, a view of the flat buffer

    @torch.no_grad()
    def to_params(self) -> None:
        for m, p in zip(self.masters, self.params, strict=True):
            if m is not p:
                p.copy_(m)

    @torch.no_grad()
    def from_params(self) -> None:
        """After loading bf16 weights into the model: masters start from them."""
        for m, p in zip(self.masters, self.params, strict=True):
            if m is not p:
                m.copy_(p)

    def state(self) -> list[torch.Tensor] | None:
        return [m.detach().cpu().clone() for m in self.masters] if self.copied else None

    @torch.no_grad()
    def load(self, masters: list[torch.Tensor] | None) -> None:
        if masters is None or not self.copied:
            self.from_params()
            return
        for m, saved in zip(self.masters, masters, strict=True):
            m.copy_(saved)
        self.to_params()
