"""Run-level records: the manifest stored beside a run's shards, and the events consumers read."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from schemas.tables import SCHEMA_VERSION


class SourceStats(BaseModel):
    model_config = ConfigDict(extra="forbid")

    read: int = 0
    kept: int = 0
    duplicate: int = 0
    quarantined: int = 0
    sampled_out: int = 0  # rows dropped by max_samples
    images: int = 0  # image parts in the kept rows (mix `images:`)
    images_stored: int = 0  # distinct images this source added to runs/<run>/images/
    dropped_parts: int = 0  # non-text parts dropped from kept rows (video/audio; images without `images:`)


class ShardInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    shard_id: int
    num_prompts: int
    sources: dict[str, int]  # prompts per source in this shard


class RunManifest(BaseModel):
    """Written once by the producer to runs/<run_id>/manifest.json; the truth `regen resume` rebuilds from."""

    model_config = ConfigDict(extra="forbid")

    schema_version: str = SCHEMA_VERSION
    run_id: str
    mix_name: str
    created_at: float
    model: str
    api: str
    sampling_hash: str
    regen_key: str
    num_prompts: int
    num_shards: int
    shards: list[ShardInfo]
    sources: dict[str, SourceStats]
    num_reused: int = 0


class ShardDoneEvent(BaseModel):
    """Appended to the run's Redis stream when an output shard is final. `path` is where the worker
    wrote it, for people reading the stream: a reader finds the file from (run_id, shard_id) under its
    own data root, since anyone who can write the stream could point `path` anywhere."""

    model_config = ConfigDict(extra="forbid")

    run_id: str
    shard_id: int = Field(ge=0)
    path: str
    num_rows: int
    num_errors: int = 0
    num_tokens: int = 0
    schema_version: str = Field(default=SCHEMA_VERSION)
