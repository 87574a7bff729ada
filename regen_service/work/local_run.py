"""Regenerate a prepared run in-process: every prompt shard through the Regenerator, output shards written.

What `regen worker` does for a shard, without Redis, leases or a server: the prompt shards the
producer wrote (regen_service.produce.prepare) are read, each record goes through
`Regenerator.regenerate` against an engine (local_engine.LocalEngine, or anything with the pool's
`complete`), and each shard's rows are written as `runs/<run>/outputs/shard-NNNNN.parquet` in prompt
order with the run id set, the layout the trainer reads. All shards' records are answered
concurrently so the engine batches across shards. For benchmarks and dry runs on one machine; the
exactly-once machinery (shard log, lease, ledger) is the worker's and is not used here.
"""

from __future__ import annotations

import asyncio
import time

from regen_service.state.storage import RunLayout, Storage
from regen_service.work.regenerate import Regenerator
from schemas.mix import MixSpec
from schemas.prompt_rows import prompts_from_table
from schemas.records import RunManifest
from schemas.rows import output_table


async def _answer_all(regen: Regenerator, records, concurrency: int):
    sem = asyncio.Semaphore(concurrency)

    async def one(rec):
        async with sem:
            return await regen.regenerate(rec)

    return await asyncio.gather(*(one(r) for r in records))


def regenerate_run(
    storage: Storage, run_id: str, mix: MixSpec, engine, tokenizer, concurrency: int = 100_000
) -> dict:
    """Answer every prompt of a prepared run; returns counts and wall time."""
    t0 = time.perf_counter()
    layout = RunLayout(storage, run_id)
    manifest = RunManifest.model_validate(storage.read_json(layout.manifest_path))
    shards = [
        (s.shard_id, prompts_from_table(storage.read_table(layout.prompt_shard(s.shard_id))))
        for s in manifest.shards
    ]
    regen = Regenerator(engine, mix, tokenizer)
    flat = [r for _, recs in shards for r in recs]
    rows = asyncio.run(_answer_all(regen, flat, concurrency))
    at = 0
    errors = tokens = 0
    for shard_id, recs in shards:
        part = rows[at : at + len(recs)]
        at += len(recs)
        for r in part:
            r.run_id = run_id
            errors += r.error is not None
            tokens += r.completion_tokens or 0
        storage.write_table_atomic(layout.output_shard(shard_id), output_table(part))
    return {
        "run_id": run_id, "rows": len(rows), "shards": len(shards), "errors": errors,
        "completion_tokens": tokens, "wall_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
