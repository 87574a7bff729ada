"""PoolConfig: how the endpoint pool connects, limits, times out, retries and ejects.

One validated model (extra keys are errors), the `pool` part of the worker's config (work/worker_config.py):
the `regen worker` options for these fields are derived from their declarations here. Units are in the
field names. Reading the API key from the environment or a file is auth.py's job; turning
this config into live endpoints is pool.py's.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator


class PoolConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    endpoints: list[str] = Field(
        min_length=1, description="SGLang or vLLM base URLs, e.g. http://gpu-1:30000"
    )
    # auto: detected per endpoint at start (engines.py); force one when a proxy hides the info paths
    engine: Literal["auto", "sglang", "vllm"] = Field(
        default="auto",
        description="what serves the endpoints: detected from their info paths, or forced (behind a proxy)",
    )
    # Sent as `Authorization: Bearer`; SecretStr keeps it out of repr() and logs.
    api_key: SecretStr | None = None

    # None: the server's max_running_requests * inflight_factor (so its queue never runs dry between
    # our requests), capped by running + max_queued_requests so we never provoke "queue full" 503s.
    max_inflight_per_endpoint: int | None = Field(
        default=None,
        ge=1,
        description="requests outstanding per endpoint [default: from the server's max_running_requests]",
    )
    inflight_factor: float = Field(default=2.0, ge=1.0)
    default_inflight_per_endpoint: int = Field(
        default=64, ge=1, description="when the server reports no limits"
    )

    connect_timeout_s: float = Field(default=10.0, gt=0)
    # Non-streaming requests only: the whole answer arrives at the end, so this must cover a full
    # generation (None: no limit besides request_timeout_s).
    read_timeout_s: float | None = Field(default=None, gt=0)
    # Streaming: no completed event for this long means the request is stuck (retryable); comments
    # (`: keepalive`) and blank lines are not progress.
    stall_timeout_s: float = Field(default=60.0, gt=0)
    # One attempt, end to end (None: unbounded). Stalls are caught sooner by stall_timeout_s; this
    # catches a server that keeps sending without ever finishing. Kimi-K2.5 thinking answers run to
    # 16K-32K tokens; at a loaded server's ~20 tok/s per request that is under 30 minutes.
    request_timeout_s: float | None = Field(
        default=3600.0, gt=0, description="one request attempt, end to end"
    )
    # A non-streaming reply (or an error body, one stream line, or one stream event's data lines
    # together) larger than this is cut, retryable:
    # 32K tokens of text plus their ids is well under 1 MiB, so 16 MiB is slack, not a limit on answers.
    max_reply_bytes: int = Field(
        default=16 << 20,
        ge=1024,
        description="a larger non-streaming reply, error body or stream line is cut (retryable)",
    )
    # A stream is cut (retryable) once it sent this many events more than the request's max_new_tokens
    # (every event carries at least one token; the extras are the role, usage and finish chunks).
    stream_slack_events: int = Field(
        default=256, ge=1, description="a stream is cut once it sent this many events past max_new_tokens"
    )
    control_timeout_s: float = Field(default=10.0, gt=0, description="health, info and model checks")

    max_attempts: int = Field(default=6, ge=1)
    backoff_initial_s: float = Field(default=0.5, ge=0)
    backoff_max_s: float = Field(default=20.0, ge=0)
    backoff_jitter_s: float = Field(default=0.5, ge=0)

    # Consecutive retryable failures that eject an endpoint (a refused connection ejects at once).
    breaker_failure_threshold: int = Field(default=5, ge=1)
    breaker_probe_initial_s: float = Field(default=0.5, gt=0)
    breaker_probe_max_s: float = Field(default=15.0, gt=0)

    stream: bool = True
    # Whether /generate stream events carry deltas (SGLang's --incremental-streaming-output) or totals.
    # auto: from /server_info's `incremental_streaming_output`, else detected from the chunks; a set
    # mode is still checked on every stream (a mismatch is a retryable StreamModeError, never a
    # truncated answer). true/false are read as incremental/cumulative.
    incremental_stream: Literal["auto", "cumulative", "incremental"] = "auto"
    health_check_on_start: bool = True

    @field_validator("incremental_stream", mode="before")
    @classmethod
    def _stream_bool(cls, v):
        return {True: "incremental", False: "cumulative"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("endpoints")
    @classmethod
    def _urls(cls, v: list[str]) -> list[str]:
        out = []
        for url in v:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"endpoint {url!r} must start with http:// or https://")
            out.append(url.rstrip("/"))
        if len(set(out)) != len(out):
            raise ValueError(f"endpoints repeat: {out}")
        return out
