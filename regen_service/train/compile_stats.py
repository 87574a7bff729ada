"""torch.compile's bookkeeping, read off dynamo's own counters: graphs compiled and seconds spent compiling.

On CUDA the draft's norm, rotary and SwiGLU (layers.py), flex attention and its block masks
(flexattn.py) and the loss chunk (loss.py) are compiled; each new shape can cost a recompile.
`compile_counts()` reads, without compiling or syncing anything:
- `graphs`: `torch._dynamo.utils.counters["stats"]["unique_graphs"]`, one per FX graph dynamo hands
  to the backend (a first compile, a recompile after a guard failed, each piece of a graph break);
- `frames`: `counters["frames"]["ok"]`, Python frames dynamo converted;
- `seconds`: `calculate_time_spent()["total_wall_time"]`, the "entire_frame_compile" plus
  "entire_backward_compile" phases (the backward of a training graph is compiled lazily, at the
  first backward; both are the process-wide totals `dynamo_timed` keeps, unchanged from torch 2.2 to
  2.13 and cleared only by torch._dynamo.reset()).
`CompileCounts.since(earlier)` gives what one stretch (a benchmark, a training run) compiled. Where
dynamo was never imported nothing was compiled: zeros, and dynamo is not imported to say so (it
costs a second). Imports torch only.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass


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
    """The process's compile totals so far (cheap: two dict reads and a sum)."""
    if "torch._dynamo.utils" not in sys.modules:
        return CompileCounts()
    from torch._dynamo.utils import calculate_time_spent, counters

    return CompileCounts(
        graphs=int(counters["stats"]["unique_graphs"]),
        frames=int(counters["frames"]["ok"]),
        seconds=float(calculate_time_spent().get("total_wall_time", 0.0)),
    )
