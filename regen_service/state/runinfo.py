"""Reading a run's own files back: its resolved mix and its manifest.

The producer stores the mix twice: `mix.yaml` exactly as the operator wrote it, and `mix.json` with
every relative path made absolute, so a worker on any host reads the same settings without knowing
where the mix file once was. Where each file lies is RunLayout's (regen_service.state.storage).
"""

from __future__ import annotations

import logging
from functools import lru_cache

from regen_service.errors import ConfigError
from regen_service.state.storage import RunLayout, Storage
from schemas.mix import MixError, MixSpec, parse_mix
from schemas.records import RunManifest

log = logging.getLogger(__name__)


def resolved_mix_dict(mix: MixSpec) -> dict:
    data = mix.identity_dict()  # a mix without `images:` writes the mix.json it wrote before images
    if mix.paths.tokenizer:
        data["target"]["tokenizer"] = mix.paths.tokenizer
    for src, spec in zip(data["sources"], mix.sources, strict=False):
        if spec.path:
            src["path"] = mix.paths.of(spec).path
    return data


@lru_cache(maxsize=64)
def _load_mix_cached(url: str, path: str) -> MixSpec:
    # Keyed by the data root's URL: each shard builds its own Storage, so the object can't be the key.
    try:
        data = Storage(url).read_json(path)
    except RecursionError:
        raise MixError(f"{path}: nested too deeply to be a mix; enqueue the mix again") from None
    except ValueError as e:
        raise MixError(f"{path}: not JSON ({e}); enqueue the mix again") from None
    return parse_mix(data, where=path)


def load_run_mix(layout: RunLayout) -> MixSpec:
    return _load_mix_cached(layout.storage.url, layout.resolved_mix_path)


def load_manifest(layout: RunLayout) -> RunManifest:
    return RunManifest.model_validate(layout.storage.read_json(layout.manifest_path))


@lru_cache(maxsize=64)
def _shard_ids_cached(url: str, run_id: str) -> frozenset[int]:
    return frozenset(s.shard_id for s in load_manifest(RunLayout(Storage(url), run_id)).shards)


def check_shard_of_run(layout: RunLayout, shard_id: int) -> None:
    """ConfigError unless the run's manifest lists the shard. A manifest is written once and never
    changed (same run id, same content), so it is read once per process and run."""
    try:
        ids = _shard_ids_cached(layout.storage.url, layout.run_id)
    except FileNotFoundError:
        raise ConfigError(f"no run {layout.run_id!r} under the data root (no manifest)") from None
    except (ValueError, RecursionError) as e:
        raise ConfigError(
            f"run {layout.run_id!r}: its manifest cannot be read ({type(e).__name__})"
        ) from None
    if shard_id not in ids:
        raise ConfigError(
            f"shard {shard_id} is not a shard of run {layout.run_id!r} (its manifest lists {len(ids)}: "
            f"{min(ids, default=0)}..{max(ids, default=-1)})"
        )


def done_shards_in_storage(layout: RunLayout, manifest: RunManifest | None = None) -> set[int]:
    """Shards whose final output file exists: the completion markers. With the manifest, only its
    shards count: a file planted under a shard id the run does not have is left alone, with a warning."""
    done = layout.output_shard_ids()
    if manifest is None:
        return done
    ids = {s.shard_id for s in manifest.shards}
    for sid in sorted(done - ids):
        log.warning("ignoring %s: run %s has no shard %d", layout.output_shard(sid), layout.run_id, sid)
    return done & ids
