"""torchrun support: process-group setup, object broadcast from rank 0, and helpers.

One process per GPU under `torchrun --nproc_per_node N`; NCCL on GPUs, gloo on the CPU. Without
torchrun's environment this is a single process and every helper is a no-op. Deciding what each
rank trains is trainer.py's (rank 0 reads the stream and broadcasts shard references).
Imports torch only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def init_distributed(device: str | None = None) -> DistContext:
    """device: 'cpu', 'cuda' or None (cuda when available)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None)
    return DistContext(rank, world, local_rank, dev)


def broadcast_object(obj, ctx: DistContext):
    """rank 0's `obj` on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0, device=ctx.device if ctx.device.type == "cuda" else None)
    return box[0]


def all_reduce_mean(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    if not ctx.distributed:
        return t
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / ctx.world


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def shutdown(ctx: DistContext, finished: bool = True) -> None:
    """Tear the process group down. finished: every rank got here past its last collective, so they meet at
    a barrier first: a gloo rank whose peer destroyed the group and exited while it was still in its own
    teardown was seen to abort ("terminate called without an active exception") after a finished run.
    False (an exception on the way out): no barrier, which would wait forever on a rank that is gone."""
    if ctx.distributed and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()
