"""Reuse: a prompt already answered under the same data root, by the same model with the same sampling
and regeneration settings (the mix's regen_key), is copied instead of asked again.

At enqueue the producer writes runs/<run_id>/reuse.parquet mapping this run's prompt ids to the
(run, shard) that already holds an answer; the shard runner copies those rows, marked `reused_from`
(regen_service.state.reuse_map reads the map back).
Rows that ended in an error are never reused. `regen enqueue --no-reuse` skips all of this.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from regen_service.state.runinfo import done_shards_in_storage, load_manifest
from regen_service.state.storage import RunLayout, Storage
from schemas.records import RunManifest
from schemas.tables import REUSE_SCHEMA


def answered_elsewhere(storage: Storage, manifest: RunManifest) -> dict[str, tuple[str, int]]:
    """prompt id -> (run id, shard id) of an answer from another run with the same regen_key."""
    found: dict[str, tuple[str, int]] = {}
    for other in RunLayout.list_runs(storage):
        if other == manifest.run_id:
            continue
        layout = RunLayout(storage, other)
        if not storage.exists(layout.manifest_path) or load_manifest(layout).regen_key != manifest.regen_key:
            continue
        for sid in sorted(done_shards_in_storage(layout)):
            table = storage.read_table(layout.output_shard(sid)).select(["prompt_id", "error", "reused_from"])
            ok = table.filter(pc.and_(pc.is_null(table["error"]), pc.is_null(table["reused_from"])))
            for pid in ok["prompt_id"].to_pylist():
                found.setdefault(pid, (other, sid))
    return found


def plan_reuse(storage: Storage, manifest: RunManifest) -> int:
    """Write this run's reuse map; returns how many of its prompts will be reused."""
    layout = RunLayout(storage, manifest.run_id)
    available = answered_elsewhere(storage, manifest)
    rows = []
    if available:
        for shard in manifest.shards:
            ids = storage.read_table(layout.prompt_shard(shard.shard_id)).column("prompt_id").to_pylist()
            rows += [
                {"prompt_id": p, "from_run": available[p][0], "from_shard": available[p][1]}
                for p in ids
                if p in available
            ]
    storage.write_table_atomic(layout.reuse_path, pa.Table.from_pylist(rows, schema=REUSE_SCHEMA))
    return len(rows)
