"""Process-wide settings, read from the environment once at start and passed down.

Only `Settings.from_env` reads os.environ; everything else receives a Settings object. Every client
of the broker (producer, workers, Flower, `regen resume`) builds its Celery configuration from the
same Settings, so they cannot disagree on the visibility timeout (see regen_service.state.queue).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    redis_url: str = DEFAULT_REDIS_URL
    data_root: str = "./data"
    key_prefix: str = Field(default="regen", pattern=r"^[A-Za-z0-9_.:-]+$")
    # One value for every broker client: a message unacked this long is redelivered. Leases (below)
    # stop a redelivered shard from running twice, so this only bounds how fast a dead worker's shard
    # comes back without `regen resume`.
    visibility_timeout_s: int = Field(default=3600, ge=10)
    lease_ttl_s: float = Field(default=30.0, gt=1)
    heartbeat_s: float = Field(default=5.0, gt=0)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # CA bundle that signed a rediss:// server's certificate (a private CA); unset: the system's store
    redis_ca_certs: str | None = None

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str) -> str:
        scheme = urlsplit(v).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                f"REGEN_REDIS_URL must start with redis://, rediss:// or unix://, got {scheme!r}://"
            )
        return v

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> Settings:
        env = os.environ if env is None else env
        values: dict = {}
        for field, var in (
            ("redis_url", "REGEN_REDIS_URL"),
            ("data_root", "REGEN_DATA_ROOT"),
            ("key_prefix", "REGEN_KEY_PREFIX"),
            ("visibility_timeout_s", "REGEN_VISIBILITY_TIMEOUT_S"),
            ("lease_ttl_s", "REGEN_LEASE_TTL_S"),
            ("heartbeat_s", "REGEN_HEARTBEAT_S"),
            ("log_level", "REGEN_LOG_LEVEL"),
            ("redis_ca_certs", "REGEN_REDIS_CA_CERTS"),
        ):
            if env.get(var):
                values[field] = env[var]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @property
    def data_root_resolved(self) -> str:
        if "://" in self.data_root:
            return self.data_root.rstrip("/")
        return str(Path(self.data_root).expanduser().resolve())

    def redis_ssl_options(self) -> dict:
        """TLS options of every Redis client (ledger, broker) for a rediss:// URL: the certificate must
        verify (against redis_ca_certs when set); {} for redis:// and unix://."""
        if not self.redis_url.startswith("rediss://"):
            return {}
        return {
            "ssl_cert_reqs": "required",
            **({"ssl_ca_certs": self.redis_ca_certs} if self.redis_ca_certs else {}),
        }

    @property
    def redis_url_redacted(self) -> str:
        return redact_url(self.redis_url)

    @property
    def queue_name(self) -> str:
        return f"{self.key_prefix}.shards"


def redact_url(url: str) -> str:
    """The URL with any password replaced by '***', for logs and status output."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    netloc = f"{user}:***@{host}" if user else f":***@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
