"""Shared fixtures: a real Redis (each test gets its own key prefix and database), a data root."""

from __future__ import annotations

import random
import uuid

import pytest
import redis

from regen_service.settings import Settings

REDIS_BASE = "redis://127.0.0.1:6379"


@pytest.fixture(scope="session")
def redis_available() -> None:
    try:
        redis.Redis.from_url(REDIS_BASE).ping()
    except redis.RedisError as e:  # pragma: no cover - the CI script starts Redis
        pytest.fail(f"Redis at {REDIS_BASE} is not reachable ({e}); start it: redis-server --daemonize yes")


@pytest.fixture
def settings(tmp_path, redis_available) -> Settings:
    """Settings for one test: a private key prefix and queue in a random Redis DB, a fresh data root."""
    db = random.randint(1, 15)
    prefix = f"regentest-{uuid.uuid4().hex[:10]}"
    s = Settings(
        redis_url=f"{REDIS_BASE}/{db}",
        data_root=str(tmp_path / "data"),
        key_prefix=prefix,
        lease_ttl_s=6.0,
        heartbeat_s=1.0,
        visibility_timeout_s=60,
    )
    yield s
    r = redis.Redis.from_url(s.redis_url)
    keys = list(r.scan_iter(f"{prefix}*"))
    if keys:
        r.delete(*keys)


@pytest.fixture
def settings_env(settings) -> dict[str, str]:
    """The same settings as environment variables, for processes the test starts."""
    return {
        "REGEN_REDIS_URL": settings.redis_url,
        "REGEN_DATA_ROOT": settings.data_root,
        "REGEN_KEY_PREFIX": settings.key_prefix,
        "REGEN_LEASE_TTL_S": str(settings.lease_ttl_s),
        "REGEN_HEARTBEAT_S": str(settings.heartbeat_s),
        "REGEN_VISIBILITY_TIMEOUT_S": str(settings.visibility_timeout_s),
    }
