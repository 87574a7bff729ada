"""Shared fixtures: a real Redis (the one REGEN_REDIS_URL names; each test gets its own key prefix),
a data root, and the `procs` marker that keeps process-starting tests out of the fast lane.

The suite never touches keys outside its own `regentest-*` prefixes and never switches databases: it
uses the database of REGEN_REDIS_URL (default redis://127.0.0.1:6379/0), so pointing the variable at a
scratch database or a private redis-server is how to keep it off a Redis that holds other data.
"""

from __future__ import annotations

import os
import uuid

import pytest
import redis

from regen_service.settings import Settings

# The one place the suite reads the broker address; Settings validates it like regen does.
REDIS_URL = Settings.from_env({"REGEN_REDIS_URL": os.environ.get("REGEN_REDIS_URL", "")}).redis_url

# A test that starts processes (simulator, workers, vLLM) is in the full suite only; `make test-fast`
# runs the rest. A module that imports these helpers from tests.procs starts processes.
_PROC_HELPERS = ("sim_server", "worker_process", "spawn", "vllm_server", "regen_cmd", "wait_run_done")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        module = getattr(item, "module", None)
        uses_procs = any(hasattr(module, name) for name in _PROC_HELPERS) if module else False
        if uses_procs or "settings_env" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.procs)


@pytest.fixture(scope="session")
def redis_available() -> None:
    try:
        redis.Redis.from_url(REDIS_URL).ping()
    except redis.RedisError as e:  # pragma: no cover - the CI script starts Redis
        pytest.fail(
            f"Redis at {Settings(redis_url=REDIS_URL).redis_url_redacted} is not reachable ({e}); start it "
            "(redis-server --daemonize yes) or point REGEN_REDIS_URL at one"
        )


@pytest.fixture
def settings(tmp_path, redis_available) -> Settings:
    """Settings for one test: a private key prefix and queue on REGEN_REDIS_URL, a fresh data root."""
    prefix = f"regentest-{uuid.uuid4().hex[:10]}"
    s = Settings(
        redis_url=REDIS_URL,
        data_root=str(tmp_path / "data"),
        key_prefix=prefix,
        lease_ttl_s=6.0,
        heartbeat_s=1.0,
        visibility_timeout_s=60,
    )
    yield s
    r = redis.Redis.from_url(s.redis_url)
    keys = list(r.scan_iter(f"{prefix}*", count=1000))
    if keys:
        r.delete(*keys)


@pytest.fixture
def settings_env(settings) -> dict[str, str]:
    """The same settings as environment variables, for processes the test starts."""
    from tests.procs import settings_env_of

    return settings_env_of(settings)
