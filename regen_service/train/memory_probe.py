"""What a training step costs in memory, measured on the trainer's own TTT step (memory.py decides).

`StepProbe(trainer, batch, soft, logits_dtype)` runs `trainer.ttt` forward and backward on synthetic
inputs of the real shapes and dtypes (aux states in the parameters' dtype, ids, targets, loss mask,
the target's draft-vocab logits and their softmax), never an optimizer step: gradients are dropped
after, parameters untouched, no random number drawn. `cuda_peak(length)` is the CUDA allocator's
peak; `saved_bytes(length)` the CPU's stand-in (what autograd saves for backward, plus inputs,
gradients and what the trainer holds). The other helpers count what the optimizer step will add:
AdamW's moments, which its first step allocates (the fp32 gradients live in the trainer's flat
buffer from the start, so held memory has them). Imports torch only.
"""

from __future__ import annotations

import contextlib

import torch


class StepProbe:
    """Synthetic batches of the real shapes and dtypes through the trainer's TTT module: forward and
    backward, gradients dropped after, parameters never touched. Inputs are constants (no RNG draw)."""

    def __init__(self, trainer, batch: int, soft: bool, logits_dtype: torch.dtype):
        self.tr, self.batch, self.soft, self.logits_dtype = trainer, batch, soft, logits_dtype
        self.dev = trainer.ctx.device
        self.dtype = trainer.draft.lm_head.weight.dtype
        self._warm = False

    def bytes_per_position(self) -> int:
        c = self.tr.dc
        per = 3 * c.target_hidden_size * self.dtype.itemsize + 3 * 8  # aux; ids, targets, loss mask
        if self.soft:  # the target's logits and their softmax in the parameters' dtype
            per += c.draft_vocab_size * (self.logits_dtype.itemsize + self.dtype.itemsize)
        return self.batch * per

    def run(self, t: int, pack=None) -> tuple[dict[int, int], int]:
        """One forward and backward at length t -> (input storages: pointer -> bytes, gradient bytes)."""
        tr, c, b, dev = self.tr, self.tr.dc, self.batch, self.dev
        aux = torch.zeros(b, t, 3 * c.target_hidden_size, device=dev, dtype=self.dtype)
        ids = (torch.arange(b * t, device=dev) % min(c.vocab_size, c.draft_vocab_size)).view(b, t)
        tgt, mask = ids.clone(), torch.ones_like(ids)
        logits = (
            torch.zeros(b, t, c.draft_vocab_size, device=dev, dtype=self.logits_dtype) if self.soft else None
        )
        module = tr.ttt
        # no collective runs in forward or backward (the gradient all-reduce is the trainer's, after), so a
        # rank that runs out of memory here leaves none of the others waiting
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x) if pack else contextlib.nullcontext()
        )
        module.train()
        try:
            with torch.enable_grad():
                with hooks:
                    probs = None if logits is None else tr.target_probs(logits)
                    loss, _ = module(aux, ids, tgt, mask, probs)
                loss.backward()
            grads = sum(nbytes(p.grad) for p in tr.draft.parameters() if p.grad is not None)
            ins = [x for x in (aux, ids, tgt, mask, logits, probs) if x is not None]
            return {x.untyped_storage().data_ptr(): nbytes(x) for x in ins}, grads
        finally:
            for p in tr.draft.parameters():
                p.grad = None
            tr.masters.grads.begin()  # what backward wrote is not a step's: the next step overwrites it

    def cuda_peak(self, t: int) -> int:
        if not self._warm:  # the first call compiles the step's kernels; measure a run that does not
            self.run(t)
            self._warm = True
        torch.cuda.synchronize(self.dev)
        torch.cuda.reset_peak_memory_stats(self.dev)
        self.run(t)
        torch.cuda.synchronize(self.dev)
        return torch.cuda.max_memory_allocated(self.dev)

    def saved_bytes(self, t: int) -> int:
        """The CPU's stand-in for a peak: what the trainer holds, plus inputs, what autograd saves for
        backward and the gradients (transients inside an op are not seen)."""
        own = {
            x.untyped_storage().data_ptr() for x in (*self.tr.draft.parameters(), *self.tr.draft.buffers())
        }
        saved: dict[int, int] = {}

        def pack(x: torch.Tensor) -> torch.Tensor:
            if x.untyped_storage().data_ptr() not in own:
                saved[x.untyped_storage().data_ptr()] = nbytes(x)
            return x

        inputs, grads = self.run(t, pack)
        return held_bytes(self.tr) + sum({**saved, **inputs}.values()) + grads


def nbytes(x: torch.Tensor) -> int:
    return x.untyped_storage().nbytes()


def held_bytes(trainer) -> int:
    """Bytes of what the trainer keeps: parameters, buffers, fp32 masters and their gradient buffer,
    optimizer state."""
    tensors = [*trainer.draft.parameters(), *trainer.draft.buffers(), *trainer.masters.masters]
    tensors.append(trainer.masters.grads.flat)
    tensors += [v for s in trainer.opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum({x.untyped_storage().data_ptr(): nbytes(x) for x in tensors}.values())


def pending_state_bytes(trainer) -> int:
    """What AdamW allocates at its first step and keeps (exp_avg, exp_avg_sq; max_exp_avg_sq with
    amsgrad): nothing for masters that have state already (a checkpoint was loaded)."""
    per = 3 if trainer.opt.defaults.get("amsgrad") else 2
    return sum(per * nbytes(m) for m in trainer.masters.masters if not trainer.opt.state.get(m))
