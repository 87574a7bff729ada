"""Training speed as users meet it: the draft trainer over batches of many sequence lengths, compiles included.

Every other training figure is at one fixed shape. A regenerated run's samples run from a few hundred
to 16K tokens, and each new padded length can cost the compiled draft a recompile and flex attention
a block mask per TTT step. `run_varlen` feeds a DraftTrainer synthetic target states in the form
scripts/bench_train.py's draft mode does (`whole`, the default: the target's last hidden state through its
final norm and full LM head each step, target_head.target_step, as training runs it; else the
draft-vocab logits handed in) in batches whose lengths
are drawn from a length distribution, pads each batch as the trainer does (lengths.bucket_length,
loss mask 0 on pads) and reports:
- tokens/s of real tokens (pads excluded) over the whole wall time from the first step's start to the
  last step's end, every compile included, and padded tokens/s beside it;
- the steady-state rate: real tokens/s over the steps during which nothing was compiled;
- compilations and compile seconds (lengths.compile_counts), the distinct padded lengths met, the flex
  block masks cached, peak CUDA memory;
- time to first step and to the trainer being built, from the process start (the kernel's start time
  of this process, /proc/self/stat: interpreter start and `import torch` included).
`packed=True` runs the same lengths as the trainer's `data.packing` does (packing.py): rows of
max_length tokens filled with whole samples in their order, every step one shape, each sample attending
to itself only; `steps` is then the number of packed batches.

Lengths: `shard_lengths(DIR)` reads a real run's output shards (runs/<run>/outputs/shard-*.parquet,
OUTPUT_SCHEMA): one sample per answered turn, `turns[].prompt_tokens + turns[].completion_tokens` (the
sample per generation the trainer takes by default for Kimi-K2.5), or a row's `input_ids` length where
it has no turn counts; errored rows skipped. Without a run, `builtin_lengths`: a log-normal of answers
with thinking, median 3,000 tokens, sigma 0.9 (p10 ~950, p90 ~9,500), clipped to [200, 16384], seeded.
Imports torch and the trainer's torch-only modules (pyarrow only to read shards): it runs on a bare
GPU host, without pydantic.
"""

from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path

import torch

from regen_service.bench.train_step import sync, target_side
from regen_service.train import flexattn
from regen_service.train.lengths import bucket_length, compile_counts
from regen_service.train.packing import Documents, pack_lengths
from regen_service.train.target_head import target_step

BUILTIN = {"median": 3000, "sigma": 0.9, "lo": 200, "hi": 16384}
BUILTIN_NAME = "builtin: log-normal, median {median}, sigma {sigma}, in [{lo}, {hi}]".format(**BUILTIN)


def builtin_lengths(n: int, seed: int = 0) -> list[int]:
    """n lengths of the built-in distribution (log-normal, median 3,000, sigma 0.9, in [200, 16384])."""
    rng = random.Random(seed)
    mu = math.log(BUILTIN["median"])
    return [
        min(BUILTIN["hi"], max(BUILTIN["lo"], round(rng.lognormvariate(mu, BUILTIN["sigma"]))))
        for _ in range(n)
    ]


def shard_lengths(folder: str | Path) -> list[int]:
    """Sample lengths of a run's output shards (module docstring); `folder` is the run's outputs folder or
    the run folder above it."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    root = Path(folder)
    files = sorted(root.glob("shard-*.parquet")) or sorted((root / "outputs").glob("shard-*.parquet"))
    if not files:
        raise FileNotFoundError(f"{root}: no output shards (shard-*.parquet) in it or in {root / 'outputs'}")
    out: list[int] = []
    for f in files:
        names = pq.read_schema(f).names
        tab = pq.read_table(f, columns=[c for c in ("turns", "input_ids", "error") if c in names])
        if "error" in names:
            tab = tab.filter(pc.is_null(tab.column("error")))
        with_turns = None
        if "turns" in names:
            turns = tab.column("turns")
            flat = pc.list_flatten(turns)
            per_turn = pc.add(
                pc.struct_field(flat, "prompt_tokens"), pc.struct_field(flat, "completion_tokens")
            )
            out += [int(v) for v in per_turn.to_pylist() if v]
            with_turns = pc.greater(pc.fill_null(pc.list_value_length(turns), 0), 0)
        if "input_ids" in names:
            ids = (
                tab.column("input_ids")
                if with_turns is None
                else tab.column("input_ids").filter(pc.invert(with_turns))
            )
            out += [int(v) for v in pc.list_value_length(ids).to_pylist() if v]
    if not out:
        raise ValueError(f"{root}: its output shards hold no answered sample with token counts")
    return out


def draw(pool: list[int], n: int, seed: int, max_length: int) -> list[int]:
    """n lengths drawn from `pool` with replacement (seeded), cut at max_length as the trainer cuts."""
    rng = random.Random(seed)
    return [min(max_length, max(2, rng.choice(pool))) for _ in range(n)]


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: its start time in /proc/self/stat); None elsewhere."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _quantiles(xs: list[int]) -> dict:
    s = sorted(xs)
    return {f"p{q}": s[min(len(s) - 1, len(s) * q // 100)] for q in (10, 50, 90, 99)}


def _plans(lengths: list[int], batch: int, bucket: str, max_length: int, packed: bool):
    """Each step's (padded length, the samples' lengths per row, Documents or None)."""
    if not packed:
        steps = len(lengths) // batch
        return [
            (bucket_length(max(lens), bucket, max_length), [[n] for n in lens], None)
            for lens in (lengths[i * batch : (i + 1) * batch] for i in range(steps))
        ]
    rows = [[lengths[i] for i in row] for row in pack_lengths(lengths, max_length)]
    out = []
    for i in range(len(rows) // batch):
        mine = rows[i * batch : (i + 1) * batch]
        out.append((max_length, mine, Documents(tuple(tuple(r) for r in mine), max_length)))
    return out


def run_varlen(tr, lengths: list[int], batch: int, bucket: str, max_length: int, soft: bool = True,
               built_age_s: float | None = None, whole: bool = True, packed: bool = False) -> dict:  # fmt: skip
    """Train `len(lengths) // batch` steps of `tr` (a DraftTrainer with its vocabulary set) on synthetic
    states, batch i holding lengths[i*batch:(i+1)*batch], padded to bucket_length(longest, bucket,
    max_length); `packed`: the lengths in packed rows of max_length (module docstring). `built_age_s`:
    process_age_s() when the trainer was built. -> the JSON record."""
    dev = tr.ctx.device
    c = tr.dc
    dtype = torch.bfloat16 if tr.bf16 else torch.float32
    lengths = [min(max_length, n) for n in lengths]  # cut as the trainer cuts
    plans = _plans(lengths, batch, bucket, max_length, packed)
    steps = len(plans)
    lengths = [n for _, rows, _ in plans for row in rows for n in row]
    cap = max(t for t, _, _ in plans)  # buckets grow with the length
    # one buffer each at the longest padded batch; a step views its first B*T rows, contiguous as the
    # trainer's inputs are (random values at pad positions cost the same as the zeros a target gives)
    g = torch.Generator(device=dev).manual_seed(0)
    aux_buf = torch.randn(batch * cap * 3 * c.target_hidden_size, generator=g, device=dev, dtype=dtype)
    ids_buf = torch.randint(0, c.draft_vocab_size, (batch * cap,), generator=g, device=dev)
    dl_buf = (
        torch.randn(batch * cap * c.draft_vocab_size, generator=g, device=dev, dtype=dtype)
        if soft and not whole
        else None
    )
    if whole:  # the target's side as bench_train's whole step
        ht = c.target_hidden_size
        last_buf = torch.randn(batch * cap * ht, generator=g, device=dev, dtype=dtype)
        norm_w, head, draft_ids = target_side(c, dev, dtype, soft, g)
    counts0 = compile_counts()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    per_step = []
    first_end_age = None
    sync()
    t_first = time.perf_counter()
    for i, (t, rows, docs) in enumerate(plans):
        lens = [sum(row) for row in rows]
        aux = aux_buf[: batch * t * 3 * c.target_hidden_size].view(batch, t, -1)
        ids = ids_buf[: batch * t].view(batch, t)
        # packed: each row's samples side by side from its start, the row's tail padding after them
        mask = (torch.arange(t, device=dev)[None] < torch.tensor(lens, device=dev)[:, None]).long()
        before = compile_counts()
        t0 = time.perf_counter()
        if whole:
            last = last_buf[: batch * t * ht].view(batch, t, ht)
            tgt, dl = target_step(last, norm_w, c.rms_norm_eps, head, draft_ids)
        else:
            tgt = ids
            dl = dl_buf[: batch * t * c.draft_vocab_size].view(batch, t, -1) if soft else None
        tr.train_batch(aux, ids, tgt, mask, draft_logits=dl, tokens=sum(lens), docs=docs)
        sync()
        dt = time.perf_counter() - t0
        if i == 0:
            first_end_age = process_age_s()
        per_step.append((t, sum(lens), dt, compile_counts().graphs - before.graphs))
    wall = time.perf_counter() - t_first
    cc = compile_counts().since(counts0)
    real = sum(r for _, r, _, _ in per_step)
    padded = sum(batch * t for t, _, _, _ in per_step)
    quiet = [(r, dt) for _, r, dt, n in per_step if n == 0]
    quiet_s = sum(dt for _, dt in quiet)
    return {
        "step": "whole" if whole else "draft", "steps": steps, "batch": batch, "max_length": max_length,
        "packing": packed, "length_bucket": None if packed else bucket, "samples": len(lengths),
        "real_tokens": real, "padded_tokens": padded, "pad_share": round(1 - real / padded, 4),
        "wall_s": round(wall, 3), "tokens_per_s": round(real / wall), "padded_tokens_per_s": round(padded / wall),
        "steady_tokens_per_s": round(sum(r for r, _ in quiet) / quiet_s) if quiet_s else None,
        "steady_steps": len(quiet), "steps_with_compiles": steps - len(quiet),
        "compiles": cc.graphs, "compile_s": round(cc.seconds, 2), "compiled_frames": cc.frames,
        "first_step_s": round(per_step[0][2], 3) if per_step else None,
        "startup_s": round(built_age_s, 2) if built_age_s is not None else None,
        "time_to_first_step_s": round(first_end_age, 2) if first_end_age is not None else None,
        "peak_mem_gib": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if dev.type == "cuda" else None,
        "distinct_lengths": sorted({t for t, _, _, _ in per_step}),
        "block_masks_cached": flexattn.ttt_block_mask.cache_info().currsize,
        "real_length_quantiles": _quantiles(lengths),
        "attention": tr.draft.midlayer.self_attn.impl, "device": str(dev),
    }  # fmt: skip
