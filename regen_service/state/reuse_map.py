"""A run's reuse map read back: the rows another run already answered for this shard's prompts.

The producer decides what is reused and writes runs/<run_id>/reuse.parquet (REUSE_SCHEMA: prompt id ->
the run and shard holding an answer; regen_service.produce.reuse); the shard runner copies those rows
instead of asking again. This module only reads the map and the rows it names, marking each with the
run it came from; which answers qualify (same regen_key, no error) is the producer's rule.

A reused row whose prompt holds images names them by hash; each must be in this run's own image store
(runs/<run>/images/, what the trainer and later runs read), so one missing there is copied from the
run the answer comes from (checked against its hash first). Usually the producer stored it already,
as the prompt is this run's too; a row whose image neither store holds is not reused, and is asked
again (and fails with the missing image's reason).
"""

from __future__ import annotations

import hashlib
import logging

import pyarrow as pa
import pyarrow.compute as pc

from regen_service.state.storage import RunLayout
from schemas.rows import OutputRow, output_rows

log = logging.getLogger(__name__)


def _images_in_store(layout: RunLayout, source: RunLayout, row: OutputRow) -> bool:
    """Whether every image the row names is in this run's store, after copying any that is missing
    from the source run's store; False (logged) when one cannot be had with the right bytes."""
    storage = layout.storage
    for ref in (r for m in row.messages or () for r in m.images or ()):
        dst = layout.image_path(ref.file_name)
        if storage.exists(dst):
            continue  # content-addressed: a file under this name holds these bytes, or is caught at send
        src = source.image_path(ref.file_name)
        data = storage.read_bytes(src) if storage.exists(src) else None
        if data is None or hashlib.sha256(data).hexdigest() != ref.sha256:
            log.warning("not reusing %s from %s: its image %s is in neither store", row.prompt_id,
                        source.run_id, ref.file_name)  # fmt: skip
            return False
        storage.write_bytes_atomic(dst, data)
    return True


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
        source = RunLayout(storage, run)
        table = storage.read_table(source.output_shard(sid))
        for row in output_rows(table.filter(pc.is_in(table["prompt_id"], pa.array(sorted(wanted))))):
            if not _images_in_store(layout, source, row):
                continue
            row.run_id = layout.run_id
            row.reused_from = run
            out[row.prompt_id] = row
    return out
