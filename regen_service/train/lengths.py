"""The shapes the compiled draft meets: length buckets for training batches, and what compiling costs.

Regenerated answers with thinking run from a few hundred to 16K tokens, and a batch is padded to its
longest sequence. Every distinct padded length is a new shape for the compiled draft (torch.compile
guards on it until it marks the dimension dynamic) and a new flex-attention block mask per TTT step
(flexattn.ttt_block_mask is cached per length). `bucket_length` rounds a batch's length up so one run
meets a bounded set of lengths:

- "off": the length itself (every distinct length is its own shape);
- "block": a multiple of 128, flex attention's block (the mask's last block is full; up to 127 pad
  tokens; one shape per 128 tokens: 128 shapes up to 16K);
- "geometric": a multiple of max(128, 2**(floor(log2 t) - 2)): blocks up to 1024, then four buckets
  per octave; padding is under 128 tokens below 1024 and under 25% of the length from 512 on, and
  128..16384 holds 24 shapes (128..32768: 28; counted by a test).

Pad positions sit after the real tokens with loss mask and attention mask 0 (data.collate), so under
causal attention the real positions' outputs, the loss and the gradients do not change
(tests/train/test_lengths.py holds that). `cap` (the trainer's max_length) keeps a bucket from
growing a batch past the longest sequence the config allows, so peak memory stays that of max_length.

What the shapes cost, read off dynamo's own counters without compiling or syncing anything
(`compile_counts()`; `CompileCounts.since(earlier)` for one stretch, a benchmark or a run):
- `graphs`: `torch._dynamo.utils.counters["stats"]["unique_graphs"]`, one per FX graph dynamo hands
  to the backend (a first compile, a recompile after a guard failed, each piece of a graph break);
- `frames`: `counters["frames"]["ok"]`, Python frames dynamo converted;
- `seconds`: `calculate_time_spent()["total_wall_time"]`, the "entire_frame_compile" plus
  "entire_backward_compile" phases (a training graph's backward is compiled lazily, at its first
  backward): process-wide totals `dynamo_timed` keeps (read in torch 2.13's source; earlier 2.x
  releases have the same function and keys), cleared only by torch._dynamo.reset().
Where dynamo was never imported nothing was compiled: zeros, without importing it (that costs a
second). Plain Python: torch is not imported here.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

BUCKET_MODES: tuple[str, ...] = ("off", "block", "geometric")
BLOCK_TOKENS = 128  # flex attention's block size (flexattn.BLOCK)


def bucket_step(t: int, mode: str) -> int:
    """The granularity a length t is rounded up to under `mode` (1 for "off")."""
    if mode == "off":
        return 1
    if mode == "block":
        return BLOCK_TOKENS
    if mode == "geometric":
        # 2**(floor(log2 t) - 2): a quarter of the octave t lies in, never finer than a block
        return max(BLOCK_TOKENS, 1 << max(0, t.bit_length() - 3))
    raise ValueError(f"length bucket {mode!r}: allowed {', '.join(BUCKET_MODES)}")


def bucket_length(t: int, mode: str, cap: int | None = None) -> int:
    """The padded length of a batch whose longest sequence has t tokens; never below t, and never above
    max(t, cap) when a cap (max_length) is given."""
    if t < 1:
        raise ValueError(f"length {t}: a batch holds at least one token")
    step = bucket_step(t, mode)
    out = -(-t // step) * step
    return min(out, max(t, cap)) if cap is not None else out


def bucketer(mode: str, cap: int | None = None) -> Callable[[int], int] | None:
    """bucket_length as a function of the length (what the target backends' example_states take); None
    for "off", so callers skip padding altogether."""
    bucket_step(BLOCK_TOKENS, mode)  # an unknown mode is refused here, not at the first batch
    return None if mode == "off" else functools.partial(bucket_length, mode=mode, cap=cap)


def bucket_lengths(lo: int, hi: int, mode: str) -> list[int]:
    """Every padded length `mode` gives for lengths lo..hi, ascending (the shapes a run can meet)."""
    out, t = [], lo
    while t <= hi:
        b = bucket_length(t, mode)
        out.append(b)
        t = b + 1
    return out


@dataclass(frozen=True)
class CompileCounts:
    graphs: int = 0
    frames: int = 0
    seconds: float = 0.0

    def since(self, earlier: CompileCounts) -> CompileCounts:
        return CompileCounts(
            self.graphs - earlier.graphs, self.frames - earlier.frames, self.seconds - earlier.seconds
        )

    def as_dict(self) -> dict:
        d = asdict(self)
        d["seconds"] = round(d["seconds"], 3)
        return d


def compile_counts() -> CompileCounts:
    """This process's torch.compile totals so far (cheap: two dict reads and a sum)."""
    if "torch._dynamo.utils" not in sys.modules:
        return CompileCounts()
    from torch._dynamo.utils import calculate_time_spent, counters

    return CompileCounts(
        graphs=int(counters["stats"]["unique_graphs"]),
        frames=int(counters["frames"]["ok"]),
        seconds=float(calculate_time_spent().get("total_wall_time", 0.0)),
    )
