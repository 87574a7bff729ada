"""The producer's storage half: a mix becomes a prepared run (prompt shards, quarantine, manifest).

`prepare_run` reads every source in mix order, normalizes each row (regen_service.produce.sources), samples
`max_samples` valid rows per source with a seeded reservoir (same mix -> same rows), drops exact
duplicates across all sources (same prompt id; the first occurrence in source order wins), shuffles
the survivors with the mix seed so every shard mixes sources (the trainer learns from the first shards
that land), and writes shards of `shard_size` prompts, the quarantine, the mix text and, LAST, the
manifest: its presence marks the run as fully prepared. `run_id_for` names a run after its mix and
data. Enqueueing tasks and the Redis ledger are the enqueue command's job, not this module's.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa

from regen_service.errors import ConfigError
from regen_service.produce.reuse import plan_reuse
from regen_service.produce.sources import (
    BadRow,
    Fields,
    ImageReader,
    RowError,
    normalize,
    prompt_id_of,
    read_rows,
)
from regen_service.produce.sources.reader import hf_kwargs
from regen_service.state.storage import RunLayout, Storage
from schemas.mix import MixSpec, SourceSpec
from schemas.prompt_rows import prompt_row, prompt_table
from schemas.records import RunManifest, ShardInfo, SourceStats
from schemas.tables import QUARANTINE_SCHEMA

RAW_LIMIT = 4096
MIB = 1 << 20


def _file_fingerprint(path: str) -> dict:
    """Size and sha256 of the first and last MiB: cheap on 100 GB files, changes when data changes."""
    p = Path(path)
    if not p.is_file():
        return {"path": path, "missing": True}
    size = p.stat().st_size
    h = hashlib.sha256()
    with p.open("rb") as f:
        h.update(f.read(MIB))
        if size > MIB:
            f.seek(max(MIB, size - MIB))
            h.update(f.read(MIB))
    return {"size": size, "head_tail_sha256": h.hexdigest()}


def _local_files(mix: MixSpec, source: SourceSpec) -> list[str]:
    if source.path is not None:
        return [mix.paths.of(source).path]
    files = hf_kwargs(mix, source).get("data_files")
    if isinstance(files, dict):
        files = [f for v in files.values() for f in (v if isinstance(v, list) else [v])]
    elif isinstance(files, str):
        files = [files]
    return [f for f in files or [] if "://" not in f and "*" not in f]


def run_id_for(mix: MixSpec) -> str:
    """`<mix name>-<12 hex>`: sha256 of the mix's canonical JSON plus each local file's fingerprint.

    Same mix on the same files -> same id (re-enqueueing is idempotent); edited data -> a new run.
    """
    h = hashlib.sha256(json.dumps(mix.identity_dict(), sort_keys=True).encode())
    for source in mix.sources:
        for path in _local_files(mix, source):
            h.update(json.dumps([source.name, _file_fingerprint(path)], sort_keys=True).encode())
    return f"{mix.name}-{h.hexdigest()[:12]}"


def _not_json(value) -> str:
    # image bytes (a Hugging Face Image column) as their size: str() of 20 MB would be an 80 MB repr
    if isinstance(value, bytes | bytearray):
        return f"<{len(value)} bytes>"
    return str(value)


def _raw_text(raw) -> str:
    """The row as read, for the quarantine: JSON, at most 4 KiB of UTF-8 (surrogates become '?')."""
    text = raw if isinstance(raw, str) else json.dumps(raw, ensure_ascii=False, default=_not_json)
    return text.encode("utf-8", "replace")[:RAW_LIMIT].decode("utf-8", "ignore")


class _Reservoir:
    """Algorithm R over valid rows, seeded by the mix seed and the source name."""

    def __init__(self, k: int, seed: int, source: str):
        self.k, self.seen, self.items = k, 0, []
        self.rng = random.Random(f"{seed}:{source}")

    def add(self, item) -> None:
        if self.seen < self.k:
            self.items.append(item)
        else:
            j = self.rng.randrange(self.seen + 1)
            if j < self.k:
                self.items[j] = item
        self.seen += 1


def _image_reader(mix: MixSpec, source: SourceSpec) -> ImageReader | None:
    """The source's image reader (paths relative to its file's folder), or None: a mix without an
    `images:` section drops image parts as regen did before it read them."""
    if mix.images is None:
        return None
    path = mix.paths.of(source).path
    return ImageReader(mix.images, str(Path(path).parent) if path else mix.base_dir)


class _ImageStore:
    """Writes each distinct image once to runs/<run>/images/<sha256>.<ext>, as valid rows name them."""

    def __init__(self, layout: RunLayout):
        self.layout, self.stored = layout, set()

    def add(self, images: dict | None, stats: SourceStats) -> None:
        for sha, image in (images or {}).items():
            if sha not in self.stored:
                self.layout.storage.write_bytes_atomic(
                    self.layout.image_path(image.ref.file_name), image.data
                )
                self.stored.add(sha)
                stats.images_stored += 1


def _read_source(
    mix: MixSpec, source: SourceSpec, stats: SourceStats, quarantine: list[dict], store: _ImageStore
):
    """(row_index, Normalized, prompt_id) for the source's valid rows, sampled, in row order.

    A valid row's images are stored as it is read (so no row's bytes wait in memory); a row sampled
    out afterwards may leave an image in the store that no prompt names."""
    fields = Fields(source.fields)
    images = _image_reader(mix, source)
    keep = _Reservoir(source.max_samples, mix.seed, source.name) if source.max_samples else None
    valid = []
    for index, raw in read_rows(mix, source):
        stats.read += 1
        if isinstance(raw, BadRow):
            quarantine.append(
                {"source": source.name, "row_index": index, "reason": raw.reason, "raw": _raw_text(raw.raw)}
            )
            continue
        try:
            n = normalize(source, raw, fields, images)
        except RowError as err:
            quarantine.append(
                {"source": source.name, "row_index": index, "reason": err.reason, "raw": _raw_text(raw)}
            )
            continue
        if n.images:
            store.add(n.images, stats)
            n = n._replace(images=None)
        item = (index, n, prompt_id_of(n))
        if keep is not None:
            keep.add(item)
        else:
            valid.append(item)
    stats.quarantined = stats.read - (keep.seen if keep else len(valid))
    if keep is not None:
        stats.sampled_out = keep.seen - len(keep.items)
        valid = sorted(keep.items, key=lambda it: it[0])
    return valid


def prepare_run(
    mix: MixSpec, storage: Storage, run_id: str, mix_text: str, *, reuse: bool = False
) -> RunManifest:
    """Normalize, sample, dedup and shard the mix into runs/<run_id>/; return the manifest (written last).

    With `reuse`, the reuse map (reuse.plan_reuse) is written before the manifest and counted in it, so
    the manifest is written once and a crash in between leaves a run that is prepared again whole.
    A run whose manifest already exists is prepared: its manifest is returned and nothing is rewritten.
    Raises ConfigError when a source cannot be read or no prompt survives.
    """
    layout = RunLayout(storage, run_id)
    if storage.exists(layout.manifest_path):
        return RunManifest.model_validate(storage.read_json(layout.manifest_path))

    stats: dict[str, SourceStats] = {}
    quarantine: list[dict] = []
    seen: set[str] = set()
    rows: list[dict] = []
    store = _ImageStore(layout)
    for source in mix.sources:
        st = stats[source.name] = SourceStats()
        for index, n, prompt_id in _read_source(mix, source, st, quarantine, store):
            if prompt_id in seen:
                st.duplicate += 1
                continue
            seen.add(prompt_id)
            st.kept += 1
            st.dropped_parts += n.num_dropped_parts
            if n.conversation is not None:
                st.images += sum(len(m.images or ()) for m in n.conversation.messages)
            rows.append(
                prompt_row(
                    prompt_id=prompt_id,
                    source=source.name,
                    row_index=index,
                    conversation=n.conversation,
                    input_ids=n.input_ids,
                    loss_mask=n.loss_mask,
                    num_dropped_parts=n.num_dropped_parts,
                )
            )

    storage.write_table_atomic(
        layout.quarantine_path, pa.Table.from_pylist(quarantine, schema=QUARANTINE_SCHEMA)
    )
    if not rows:
        counts = {name: s.model_dump() for name, s in stats.items()}
        first = "; ".join(f"{q['source']}[{q['row_index']}]: {q['reason']}" for q in quarantine[:3])
        raise ConfigError(
            f"mix {mix.name!r}: no prompts to regenerate (per source: {counts}); first problems: {first}"
        )

    random.Random(f"{mix.seed}:shuffle").shuffle(rows)
    shards: list[ShardInfo] = []
    for shard_id, start in enumerate(range(0, len(rows), mix.shard_size)):
        chunk = rows[start : start + mix.shard_size]
        storage.write_table_atomic(layout.prompt_shard(shard_id), prompt_table(chunk))
        per_source = Counter(r["source"] for r in chunk)
        shards.append(ShardInfo(shard_id=shard_id, num_prompts=len(chunk), sources=dict(per_source)))

    storage.write_bytes_atomic(layout.mix_path, mix_text.encode("utf-8"))
    manifest = RunManifest(
        run_id=run_id,
        mix_name=mix.name,
        created_at=time.time(),
        model=mix.target.model,
        api=mix.target.api,
        sampling_hash=mix.sampling.settings_hash(),
        regen_key=mix.regen_key(),
        num_prompts=len(rows),
        num_shards=len(shards),
        shards=shards,
        sources=stats,
    )
    if reuse:
        manifest.num_reused = plan_reuse(storage, manifest)
    storage.write_json_atomic(layout.manifest_path, manifest.model_dump(mode="json"))
    return manifest
