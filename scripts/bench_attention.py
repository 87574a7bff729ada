"""Micro-benchmark: the causal half of the TTT attention per kernel, whole rows and packed rows' documents.

regen_service/bench/attention.py says what it times (flash_ttt's own calls, first-call seconds, documents of
lengths seen before and of new ones). One JSON line per row length. On a GPU host, the Kimi-K2.5 draft's
heads (56 query and kv heads of 128) and a packed 16K row of the built-in length mix:
    PYTHONPATH=. python3 scripts/bench_attention.py --seq 8192,16384 --backends fa4,cudnn,flash \
        --heads 56 --kv-heads 56 --docs 16384
Without a GPU only `--backends reference` runs. docs/training.md quotes its figures.
"""

from __future__ import annotations

import argparse
import json

import torch

from regen_service.bench import attention
from regen_service.bench.varlen import builtin_lengths
from regen_service.train import flash_ttt
from regen_service.train.packing import pack_lengths


def doc_lengths(row_len: int, seed: int = 0) -> list[int]:
    """The documents of the first packed row holding two or more of the built-in length mix (bench/varlen.py)."""
    pool = [min(row_len, n) for n in builtin_lengths(400, seed)]
    rows = pack_lengths(pool, row_len)
    return [pool[i] for i in next((r for r in rows if len(r) >= 2), rows[0])]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", default="8192,16384", help="comma-separated row lengths")
    p.add_argument("--backends", default="fa4,cudnn,flash", help=f"comma-separated, of {flash_ttt.BACKENDS}")
    p.add_argument("--heads", type=int, default=56)
    p.add_argument("--kv-heads", type=int, default=56)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--docs", type=int, default=0, help="also time a packed row of this length (0: no)")
    p.add_argument("--repeats", type=int, default=10)
    a = p.parse_args()
    backends = a.backends.split(",")
    if bad := [b for b in backends if b not in flash_ttt.BACKENDS]:
        p.error(f"--backends {','.join(bad)}: allowed {', '.join(flash_ttt.BACKENDS)}")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and backends != ["reference"]:
        p.error("no GPU here: only --backends reference runs on the CPU")
    for t in (int(x) for x in a.seq.split(",")):
        docs = doc_lengths(t) if a.docs == t else None
        rec = attention.run(backends, t, a.heads, a.kv_heads, a.head_dim, docs, dev, a.repeats)
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
