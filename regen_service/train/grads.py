"""fp32 weight gradients accumulated where they are made: one flat buffer, written by the matrix products.

The draft's layer runs once per TTT step, so each of its weights is used 7 times a step. Through plain
autograd each weight kept a bf16 `.grad`, every later use added its part in bf16 (a pass over the
gradient per use, rounding at each), and the optimizer then cast the sum to fp32: at Kimi-K2.5 draft
shapes ~10 ms a step of passes over ~1.1B gradient entries, and 7 bf16 roundings. Here every trainable
parameter has `main_grad`, an fp32 view into one flat buffer this module owns, and the linears
(linear.py) and the head loss (loss.py) accumulate their weight gradients into it inside the GEMM:
cuBLAS with fp32 output and beta=1 (aten's addmm.dtype_out, CUDA, torch >= 2.8; the CPU adds an fp32
product). A step's first write to a weight overwrites (beta=0), so nothing zeroes the buffer. Short uses
are held until backward ends and a weight's uses are made as one product (`weight_grad`, `flush`). What goes
through plain autograd (the norms' weights) is folded in by `finish`, after the deferred fix-ups the
linears registered (linear.py's embedding-half gradient). The flat buffer is then the fp32 masters'
`.grad` as it stands (optim.py): one norm, one all-reduce across ranks, read by the fused AdamW in place.
Megatron-LM calls this gradient-accumulation fusion. Imports torch only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

# aten's mixed-precision GEMM into an fp32 output (CUDA kernels only)
ADDMM_FP32_OUT = "dtype_out" in torch.ops.aten.addmm.overloads()


# A linear's weight gradient per use is an fp32 read-modify-write of the whole gradient over K = the use's
# rows (cuBLAS beta=1; in session 2's 8K profile the fp32-output weight gradients ran at 661-674 TFLOP/s,
# the forward products of the same sizes at 688-726). The draft's layer is used 7 times a step (TTT), so
# for short sequences that write is a large part of each product: uses of fewer rows than this are held
# and made as one product over all 7 (`GradBuffer.flush`). Every use held, against every use made at once,
# on one H200 at Kimi-K2.5 shapes, the whole step (docs/training.md, issue 21's seventh session): +2.9% at
# 2K tokens, +0.3% at 8K, -0.3% at 16K (the concatenations, ~6 ms at 8K, eat the GEMMs' gain), peak
# memory the same at all three. So from 8K rows on each use is made at once, as before.
HOLD_BELOW_ROWS = 8192


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, overwrite: bool) -> None:
    """out (fp32) = a @ b (overwrite) or out += a @ b, the product accumulated in fp32."""
    if out.is_cuda and a.dtype != torch.float32 and ADDMM_FP32_OUT:
        torch.ops.aten.addmm.dtype_out(out, a, b, torch.float32, beta=0 if overwrite else 1, out=out)
    elif overwrite:
        torch.mm(a.float(), b.float(), out=out)
    else:
        out.addmm_(a.float(), b.float())


class GradBuffer:
    """The fp32 gradients of `params` (the trainable ones), as `p.main_grad` views into `self.flat`.
    `hold_below_rows`: linear uses of fewer rows are held to the end of backward (`weight_grad`).
    A step: `begin()`, forward and backward (linear.py writes through `weight_grad`, loss.py through
    `add`), `finish()`; then `self.flat` holds every gradient."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = [p for p in params if p.requires_grad]
        dev = self.params[0].device if self.params else torch.device("cpu")
        self.flat = torch.zeros(sum(p.numel() for p in self.params), dtype=torch.float32, device=dev)
        offset = 0
        for p in self.params:
            p.main_grad = self.flat[offset : offset + p.numel()].view(p.shape)
            p.grad_buffer = self
            offset += p.numel()
        self._written: set[int] = set()
        self._deferred: dict[object, Callable[[], None]] = {}
        self._held: dict[int, tuple[torch.nn.Parameter, list]] = {}
        self.hold_below_rows = HOLD_BELOW_ROWS

    def begin(self) -> None:
        """A new step: every parameter's next write overwrites; pending fix-ups and stray `.grad`s (a
        forward and backward that never reached `finish`, such as the memory probe's) are dropped."""
        self._written.clear()
        self._deferred.clear()
        self._held.clear()
        for p in self.params:
            p.grad = None

    def claim(self, p: torch.nn.Parameter) -> bool:
        """True when nothing wrote p's gradient yet this step (the write overwrites main_grad: `mm`, `add`,
        or loss.py writing it whole itself). p counts as written from here on either way."""
        first = id(p) not in self._written
        self._written.add(id(p))
        return first

    def mm(self, p: torch.nn.Parameter, a: torch.Tensor, b: torch.Tensor) -> None:
        """p.main_grad += a @ b (the first write of a step overwrites)."""
        mm_into(p.main_grad, a, b, self.claim(p))

    def weight_grad(self, p: torch.nn.Parameter, dy: torch.Tensor, x: torch.Tensor) -> None:
        """p.main_grad += dy.T @ x for one use of a linear (dy [rows, out], x [rows, in]): made now, or,
        for uses of fewer than `hold_below_rows` rows, held and made at the end of this backward pass
        with the pass's other uses of p as one product over all their rows (`flush`)."""
        if dy.shape[0] >= self.hold_below_rows:
            self.mm(p, dy.T, x)
            return
        if not self._held:  # the engine runs it once backward's last node is done
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        self._held.setdefault(id(p), (p, []))[1].append((dy, x))

    def flush(self) -> None:
        """The held uses, one GEMM per parameter over the rows of all of them (K = uses x rows). The rows
        several parameters read (q/k/v's input, gate/up's) are concatenated once, and each parameter's
        operands are let go once its product is queued: one concatenated set is alive at a time."""
        held, self._held = self._held, {}
        last_ins, last_x = None, None
        for p, uses in held.values():
            dys, ins = [d for d, _ in uses], [x for _, x in uses]
            uses.clear()
            if not _same(ins, last_ins):
                last_ins = last_x = None  # freed before the next concatenation is made, not after
                last_ins, last_x = ins, ins[0] if len(ins) == 1 else torch.cat(ins)
            dy = dys[0] if len(dys) == 1 else torch.cat(dys)
            del dys, ins
            mm_into(p.main_grad, dy.T, last_x, self.claim(p))
            del dy

    def add(self, p: torch.nn.Parameter, g: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """p.main_grad += g (* scale, a 0-dim tensor: the incoming gradient of a scalar loss)."""
        main = p.main_grad
        first = self.claim(p)
        if scale is None:
            main.copy_(g) if first else main.add_(g)
        elif first:
            torch.mul(g, scale, out=main)
        else:
            main.addcmul_(g, scale)

    def defer(self, key: object, fn: Callable[[], None]) -> None:
        """Run fn once in `finish`, before autograd's gradients are folded in (one entry per key a step)."""
        self._deferred.setdefault(key, fn)

    def finish(self) -> None:
        """After backward: the deferred fix-ups, then each parameter's autograd `.grad` (if any) folded into
        its main_grad and cleared; a parameter nothing wrote this step gets zeros."""
        for fn in self._deferred.values():
            fn()
        self._deferred.clear()
        for p in self.params:
            if p.grad is not None:
                self.add(p, p.grad)
                p.grad = None
            elif id(p) not in self._written:
                p.main_grad.zero_()
        self._written.clear()  # the step's gradients are whole: the next write starts the next step

    def all_reduce_mean(self, world_size: int) -> None:
        """The mean over ranks, in place: one collective over the flat buffer (what DDP's buckets did)."""
        if world_size > 1:
            dist.all_reduce(self.flat, op=dist.ReduceOp.SUM)
            self.flat.div_(world_size)

    def norm(self) -> torch.Tensor:
        return torch.linalg.vector_norm(self.flat)


def _same(a: list[torch.Tensor], b: list[torch.Tensor] | None) -> bool:
    return b is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def owner(w: torch.Tensor) -> GradBuffer | None:
    """The buffer a parameter's gradient goes to, when autograd records (None: plain autograd)."""
    buf = getattr(w, "grad_buffer", None)
    return buf if buf is not None and w.requires_grad and torch.is_grad_enabled() else None
