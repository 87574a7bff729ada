"""Reading a run's own files back: its resolved mix and its manifest.

The producer stores the mix twice: `mix.yaml` exactly as the operator wrote it, and `mix.json` with
every relative path made absolute, so a worker on any host reads the same settings without knowing
where the mix file once was. Where each file lies is RunLayout's (regen_service.state.storage).
"""

from __future__ import annotations

from functools import lru_cache

from regen_service.state.storage import RunLayout, Storage
from schemas.mix import MixSpec, parse_mix
from schemas.records import RunManifest


def resolved_mix_dict(mix: MixSpec) -> dict:
    data = mix.model_dump(mode="json")
    if mix.target.tokenizer:
        data["target"]["tokenizer"] = mix.resolve(mix.target.tokenizer)
    for src, spec in zip(data["sources"], mix.sources, strict=False):
        if spec.path:
            src["path"] = mix.resolve(spec.path)
    return data


@lru_cache(maxsize=64)
def _load_mix_cached(url: str, path: str) -> MixSpec:
    # Keyed by the data root's URL: each shard builds its own Storage, so the object can't be the key.
    return parse_mix(Storage(url).read_json(path), where=path)


def load_run_mix(layout: RunLayout) -> MixSpec:
    return _load_mix_cached(layout.storage.url, layout.resolved_mix_path)


def load_manifest(layout: RunLayout) -> RunManifest:
    return RunManifest.model_validate(layout.storage.read_json(layout.manifest_path))


def done_shards_in_storage(layout: RunLayout) -> set[int]:
    """Shards whose final output file exists: the completion markers."""
    return layout.output_shard_ids()
