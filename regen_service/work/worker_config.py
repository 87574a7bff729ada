"""WorkerConfig: everything `regen worker` is started with, declared once, nested by what it governs.

`pool` is the endpoint client's own config (client/config.py's PoolConfig: endpoints, engine, key,
in-flight limits, timeouts, retries); `bounds` are the worker's memory and patience limits; `shard_log`
how often answered rows are made durable; the rest names the process (Celery node, metrics server,
whether a tokenizer's code may run). Each field's type, default, bounds and description are the only
declaration of that setting: the `regen worker` options are derived from them (cli/config_options.py),
and the runtime passes `pool` to the pool unchanged. Validation only; nothing here reads os.environ.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from regen_service.work.client.config import PoolConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WorkerBounds(_Strict):
    """How much a worker holds at once, and how long it waits for an endpoint."""

    max_shards_in_hand: int = Field(
        default=64,
        ge=1,
        description="memory bound on shards held at once; the worker takes another shard whenever the prompts it "
        "holds cannot fill its in-flight budget (--concurrency is the old name)",
    )
    max_prompts_in_hand: int = Field(
        default=50_000, ge=1, description="memory bound: no further shard while this many prompts wait"
    )
    exit_after_no_endpoint_s: float | None = Field(
        default=None,
        gt=0,
        description="exit with status 3 after this long without a usable endpoint, for compose/systemd to restart "
        "the worker [default: keep checking the endpoints with backoff]",
    )
    endpoint_retry_max_s: float = Field(
        default=30.0, gt=0, description="longest wait between checks of endpoints that failed their start"
    )
    # Image bytes ride inline in each request (base64 adds a third): a bound keeps a prompt with many
    # large images from building a request the server refuses or a worker cannot hold many of. Above
    # the mix's default max_image_bytes (20 MB) three times over, so a few full-size images pass.
    max_request_image_bytes: int = Field(
        default=64_000_000,
        ge=1,
        description="most image bytes one request may carry (summed over its image parts, before base64); "
        "a prompt above it fails as a terminal row error with the reason",
    )


class ShardLogConfig(_Strict):
    """When the shard log flushes answered rows to storage (state/shard_log.py): whichever comes first."""

    flush_rows: int = Field(default=64, ge=1)
    flush_interval_s: float = Field(default=1.0, gt=0)


class WorkerConfig(_Strict):
    """What `regen worker` was started with; validated once, then passed down."""

    pool: PoolConfig
    bounds: WorkerBounds = Field(default_factory=WorkerBounds)
    shard_log: ShardLogConfig = Field(default_factory=ShardLogConfig)
    metrics_port: int | None = Field(default=None, description="serve Prometheus metrics on this port")
    metrics_address: str = Field(
        default="127.0.0.1", description="address the metrics server binds (0.0.0.0: every interface)"
    )
    hostname: str | None = Field(default=None, description="Celery node name [default: regen@<host>-<pid>]")
    trust_remote_code: bool = Field(
        default=False,
        description="take api: generate runs whose mix sets target.trust_remote_code and run their tokenizer's code "
        "here; without it such a run's shards fail with the reason in `regen status` (a mix on the "
        "data root never grants this by itself)",
    )
