"""Reading a run's own files back: its resolved mix and its manifest.

The producer stores the mix twice: `mix.yaml` exactly as the operator wrote it, and `mix.json` with
every relative path made absolute, so a worker on any host reads the same settings without knowing
where the mix file once was.
"""

from __future__ import annotations

from functools import lru_cache

from regen_service.storage import RunLayout, Storage
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


def resolved_mix_path(layout: RunLayout) -> str:
    return f"{layout.run_dir}/mix.json"


@lru_cache(maxsize=64)
def _load_mix_cached(url: str, path: str) -> MixSpec:
    # Keyed by the data root's URL: each shard builds its own Storage, so the object can't be the key.
    return parse_mix(Storage(url).read_json(path), where=path)


def load_run_mix(layout: RunLayout) -> MixSpec:
    return _load_mix_cached(layout.storage.url, resolved_mix_path(layout))


def load_manifest(layout: RunLayout) -> RunManifest:
    return RunManifest.model_validate(layout.storage.read_json(layout.manifest_path))


def done_shards_in_storage(layout: RunLayout) -> set[int]:
    """Shards whose final output file exists: the completion markers."""
    done = set()
    for p in layout.storage.ls(layout.outputs_dir):
        name = p.rsplit("/", 1)[1]
        if name.startswith("shard-") and name.endswith(".parquet"):
            done.add(int(name[len("shard-") : -len(".parquet")]))
    return done
