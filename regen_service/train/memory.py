"""Whether a training step at `max_length` fits the GPU, found before the first step runs.

`fit_check(trainer, max_length, batch_size)` measures the trainer's own TTT step (memory_probe.py:
forward and backward through `trainer.ttt`, never an optimizer step) at two short lengths and fits
peak = fixed + length x per-position bytes (flex attention never builds T^2 scores: the step grows
linearly), adds the AdamW moments the first optimizer step allocates, bounds the optimizer step itself
(inputs still held; the fp32 gradients are held from the start), and compares the peak at `max_length` with what the device
can give. A length the line passes is then tried once for real, so an out-of-memory cannot happen at a
length the check passed; when that trial overshoots, the length named is found by a few more trials
(`search_largest`). A refusal is LengthDoesNotFitError (a ConfigError) naming the fields to lower and
the largest length that fits, a multiple of 128. On the CPU it is skipped unless given `budget_bytes`
(tests). Imports torch and regen's plain-Python errors only: the GPU benchmark runs it without pydantic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from regen_service.errors import LengthDoesNotFitError
from regen_service.train.memory_probe import StepProbe, held_bytes, pending_state_bytes

PROBE_LENGTHS = (512, 1024)
MARGIN = 0.05  # of what the device has, kept back for fragmentation and allocations outside the step
MULTIPLE = 128  # flex attention's block: lengths suggested are whole blocks
TRIES = 8  # trial steps that look for the largest length after the line undershot: ~1/256 of max_length
FIELDS = ("data.max_length", "data.batch_size")


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares (fixed, per_position) of bytes = fixed + per_position x length over (length, bytes)
    points at two or more distinct lengths."""
    if len({t for t, _ in points}) < 2:
        raise ValueError("fit_line needs points at two distinct lengths at least")
    n = len(points)
    mt, mb = sum(t for t, _ in points) / n, sum(b for _, b in points) / n
    slope = sum((t - mt) * (b - mb) for t, b in points) / sum((t - mt) ** 2 for t, _ in points)
    return mb - slope * mt, slope


def largest_fitting(fixed: float, per_token: float, budget: float, multiple: int = MULTIPLE) -> int:
    """The largest length, a multiple of `multiple`, with fixed + per_token x length <= budget (0: none)."""
    if per_token <= 0:
        raise ValueError(f"largest_fitting: per_token must be positive (got {per_token})")
    return max(0, int((budget - fixed) // (per_token * multiple)) * multiple)


@dataclasses.dataclass(frozen=True)
class FitReport:
    """The check's figures, in bytes: fixed is what the step needs at any length (the larger of the two
    intercepts: forward and backward, optimizer step), per_token what each token of the batch adds."""

    max_length: int
    batch_size: int
    fixed_bytes: int
    per_token_bytes: float
    predicted_bytes: int
    measured_bytes: int | None  # the trial step at max_length (None: not run, or out of memory)
    budget_bytes: int
    largest_length: int

    def summary(self) -> str:
        measured = "not run" if self.measured_bytes is None else _size(self.measured_bytes)
        return (
            f"step memory: fixed {_size(self.fixed_bytes)} + {self.per_token_bytes / 2**20:.3f} MiB per token; "
            f"max_length {self.max_length} x batch {self.batch_size}: predicted {_size(self.predicted_bytes)}, "
            f"measured {measured}, of {_size(self.budget_bytes)} usable; the largest length that fits "
            f"is {self.largest_length:,}"
        )


def fit_check(
    trainer,
    max_length: int,
    batch_size: int,
    *,
    soft: bool = True,
    logits_dtype: torch.dtype = torch.float32,
    budget_bytes: int | None = None,
    measure: Callable[[int], int] | None = None,
    probe_lengths: Sequence[int] = PROBE_LENGTHS,
    margin: float = MARGIN,
    fields: tuple[str, str] = FIELDS,
) -> FitReport | None:
    """Refuse (LengthDoesNotFitError) a max_length x batch_size whose step would not fit; the figures
    otherwise. soft: the step gets the target's draft-vocab logits (`logits_dtype`, fp32 from the
    target backends) and their softmax. `measure(length)` -> peak bytes of one forward and backward
    (default: the CUDA allocator's peak; on the CPU, what autograd saves). `fields`: the two settings
    the message tells the operator to lower. Every rank of a torchrun job calls it and gets one verdict."""
    dev = trainer.ctx.device
    cuda = dev.type == "cuda"
    if budget_bytes is None and not cuda:
        return None
    probe = StepProbe(trainer, batch_size, soft, logits_dtype)
    if budget_bytes is None:
        # memory this process's allocator holds counts as ours: the step can reuse it
        usable = torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev)
        budget = int(usable * (1 - margin))
    else:
        usable = budget = int(budget_bytes)
    where = f"this GPU ({_size(budget)} usable)" if cuda else f"the {dev.type} ({_size(budget)} usable)"
    try:
        report, why = _judge(
            trainer, probe, measure or (probe.cuda_peak if cuda else probe.saved_bytes),
            max_length, probe_lengths, usable, budget, where,
        )  # fmt: skip
    finally:
        if cuda:
            torch.cuda.empty_cache()  # the probes' blocks go back to the device, for the target too
    everywhere, largest = _agree(trainer.ctx, why is None, report.largest_length)
    if not everywhere:
        why = why or f"fits {where} but not another rank's GPU"
        raise LengthDoesNotFitError(_message(report, trainer, fields, why, largest), largest_length=largest)
    return report


def _judge(trainer, probe, measure, max_length, probe_lengths, usable, budget, where):
    """-> (the figures, why it does not fit or None). An out-of-memory in a probe is a verdict, not an
    error: leaving its handler drops the traceback and the activations its frames hold."""
    points = []
    for t in _probe_lengths(max_length, probe_lengths):
        try:
            points.append((t, measure(t)))
        except torch.OutOfMemoryError:
            why = f"does not fit {where}: a trial step at only {t} tokens ran out of memory"
            return FitReport(max_length, probe.batch, 0, 0.0, 0, None, budget, 0), why
    fixed, slope = fit_line(points)
    inputs = probe.bytes_per_position()
    slope = max(slope, inputs)  # the inputs alone grow this much per position: noise cannot undercut it
    pending = pending_state_bytes(trainer)
    held = torch.cuda.memory_allocated(probe.dev) if probe.dev.type == "cuda" else held_bytes(trainer)
    # the optimizer step: activations are gone, the inputs are still held; the fp32 gradients are the
    # trainer's flat buffer, in `held` already (grads.py)
    step_fixed = held + pending
    fixed = max(fixed, held) + pending  # a line through super-linear points (eager attention) dips below

    def report(per_position: float, measured: int | None = None) -> FitReport:
        peak = max(fixed + per_position * max_length, step_fixed + inputs * max_length)
        fit = min(largest_fitting(fixed, per_position, budget), largest_fitting(step_fixed, inputs, budget))
        top = int(max(fixed, step_fixed))
        return FitReport(max_length, probe.batch, top, slope / probe.batch, int(peak), measured, budget, fit)

    predicted = report(slope)
    if predicted.predicted_bytes > budget:
        return predicted, f"needs ~{_size(predicted.predicted_bytes)} on {where}"
    oom = False
    try:
        measured = int(measure(max_length)) + pending  # the trial ran without the AdamW moments
    except torch.OutOfMemoryError:
        oom, measured = True, usable + pending  # at least
    if not oom and measured <= budget:
        return report(slope, measured), None
    why = (
        f"needs more than {where}: a trial step at that length ran out of memory"
        if oom
        else f"needs ~{_size(measured)} on {where}, as a trial step at that length measured"
    )

    def fits(t: int) -> bool:
        try:
            return int(measure(t)) + pending <= budget
        except torch.OutOfMemoryError:
            return False

    # the line undershot, so the length named is found by trial steps; after a measured overshoot the
    # first tried is where the line through the trial's figure puts it
    guess = None if oom else report((measured - fixed) / max_length).largest_length
    top = max(points)[0] // MULTIPLE * MULTIPLE  # the longest probe fitted: a floor
    found = search_largest(fits, top if max(points)[1] + pending <= budget else 0, max_length, guess)
    r = report(slope, None if oom else measured)
    return dataclasses.replace(r, largest_length=min(found, r.largest_length)), why


def search_largest(fits: Callable[[int], bool], lo: int, hi: int, guess: int | None = None) -> int:
    """The largest multiple of MULTIPLE in [lo, hi) that `fits` (lo fits or is 0, hi does not), in at
    most TRIES calls of `fits` (each a trial step), the first at `guess` when it lies between."""
    t = guess
    for _ in range(TRIES):
        if t is None or not lo < t // MULTIPLE * MULTIPLE < hi:
            t = (lo + hi) // 2
        t = t // MULTIPLE * MULTIPLE
        if not lo < t < hi:
            break
        lo, hi = (t, hi) if fits(t) else (lo, t)
        t = None
    return lo


def _probe_lengths(max_length: int, probe_lengths: Sequence[int]) -> list[int]:
    below = sorted({t for t in probe_lengths if t < max_length})
    if len(below) >= 2:
        return below
    return [max(1, max_length // 4), max(2, max_length // 2)]


def _agree(ctx, ok: bool, largest: int) -> tuple[bool, int]:
    """One verdict for all ranks (a rank refusing alone would leave the others waiting at a collective)."""
    if not ctx.distributed:
        return ok, largest
    t = torch.tensor([int(ok), largest], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t[0]), int(t[1])


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def _shapes(trainer) -> str:
    c = trainer.dc
    attn = f"{c.num_attention_heads}x{c.head_dim} heads" + (" (MLA)" if c.draft_arch == "mla" else "")
    return (
        f"hidden {c.hidden_size}, {attn}, intermediate {c.intermediate_size}, target vocab {c.vocab_size}, "
        f"draft vocab {c.draft_vocab_size}, TTT {trainer.ttt.ttt_length}, "
        f"{'bf16' if trainer.bf16 else 'fp32'} parameters"
    )


def _message(r: FitReport, trainer, fields: tuple[str, str], why: str, largest: int) -> str:
    length, batch = fields
    head = (
        f"{length} {r.max_length} at {batch} {r.batch_size} {why}: at these draft shapes ({_shapes(trainer)})"
    )
    if largest > 0:
        fits = f"the largest length that fits is {largest:,} tokens (a multiple of {MULTIPLE})"
        return f"{head} {fits}; lower {length} or {batch}"
    fix = f"lower {batch}" if r.batch_size > 1 else "free memory on the GPU or use a larger one"
    if r.fixed_bytes == 0:  # a probe ran out of memory: no line to say more from
        return f"{head} the length that fits is shorter than the probes; lower {length}, or {fix}"
    return (
        f"{head} not even {MULTIPLE} tokens fit (the step's fixed part, weights, fp32 masters and AdamW state "
        f"included, is ~{_size(r.fixed_bytes)}; each token adds ~{_size(r.per_token_bytes)}); {fix}"
    )
