"""A run's reuse map read back: the rows another run already answered for this shard's prompts.

The producer decides what is reused and writes runs/<run_id>/reuse.parquet (REUSE_SCHEMA: prompt id ->
the run and shard holding an answer; regen_service.produce.reuse); the shard runner copies those rows
instead of asking again. This module only reads the map and the rows it names, marking each with the
run it came from; which answers qualify (same regen_key, no error) is the producer's rule.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from regen_service.state.storage import RunLayout
from schemas.rows import OutputRow, output_rows


def reused_rows(layout: RunLayout, prompt_ids: set[str]) -> dict[str, OutputRow]:
    """Rows to copy for this shard's prompts, keyed by prompt id, marked with the run they came from."""
    storage = layout.storage
    path = layout.reuse_path
    if not prompt_ids or not storage.exists(path):
        return {}
    plan = [r for r in storage.read_table(path).to_pylist() if r["prompt_id"] in prompt_ids]
    by_source: dict[tuple[str, int], set[str]] = {}
    for r in plan:
        by_source.setdefault((r["from_run"], r["from_shard"]), set()).add(r["prompt_id"])
    out: dict[str, OutputRow] = {}
    for (run, sid), wanted in by_source.items():
        table = storage.read_table(RunLayout(storage, run).output_shard(sid))
        for row in output_rows(table.filter(pc.is_in(table["prompt_id"], pa.array(sorted(wanted))))):
            row.run_id = layout.run_id
            row.reused_from = run
            out[row.prompt_id] = row
    return out
