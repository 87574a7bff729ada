"""`regen demo` (what `make demo` runs) on a machine where no Redis answers: it starts a private
redis-server for the run and stops it afterwards; without a redis-server binary, one line that says how
to install one. The real CLI, a real redis-server, the bundled mix."""

from __future__ import annotations

import os
import re
import subprocess

import redis

from regen_service.localproc import free_port
from tests.procs import regen_cmd


def _demo(tmp_path, **env) -> subprocess.CompletedProcess:
    nowhere = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    full = {**os.environ, "REGEN_REDIS_URL": nowhere, "REGEN_DATA_ROOT": str(tmp_path / "data"), **env}
    return subprocess.run(
        regen_cmd("demo"), env=full, capture_output=True, text=True, timeout=600, cwd=tmp_path
    )


def test_demo_starts_and_stops_a_private_redis(tmp_path):
    out = _demo(tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    m = re.search(r"started a private redis-server at (redis://127\.0\.0\.1:\d+/0)", out.stdout)
    assert m, out.stdout
    assert "demo finished" in out.stdout and "runs/" in out.stdout
    try:  # stopped afterwards
        redis.Redis.from_url(m[1], socket_connect_timeout=1).ping()
        raise AssertionError(f"the demo's private Redis at {m[1]} still answers")
    except redis.ConnectionError:
        pass


def test_demo_without_redis_server_says_how_to_install_one(tmp_path):
    out = _demo(tmp_path, PATH=str(tmp_path / "empty-bin"))
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert "no redis-server on PATH" in lines[0] and "apt-get install -y redis-server" in lines[0]
    assert not (tmp_path / "data" / "runs").exists()
