"""What the network sees: Flower and the worker's metrics server listen on 127.0.0.1 unless told
otherwise, Flower refuses empty passwords and answers 401 on every route but /healthcheck (/metrics
and the API included) without the credentials."""

from __future__ import annotations

import os
import subprocess
import time

import httpx
import psutil
import pytest

from tests.procs import free_port, regen_cmd, spawn, stop, wait_http, worker_process


def listening(pid: int, port: int) -> set[str]:
    """Addresses the process (or its children) listens on at `port`."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return {c.laddr.ip for p in procs for c in p.net_connections("inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}  # fmt: skip


def wait_listening(pid: int, port: int, timeout_s: float = 60) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = listening(pid, port)
        if found:
            return found
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on port {port}")


@pytest.mark.parametrize("auth", ["ops:", ":pw", "ops", "ok:pw,other:"])
def test_flower_refuses_empty_passwords(auth, settings_env):
    res = subprocess.run(regen_cmd("flower", "--port", str(free_port())), capture_output=True, text=True,
                         env={**os.environ, **settings_env, "FLOWER_BASIC_AUTH": auth}, timeout=60)  # fmt: skip
    assert res.returncode != 0 and "both parts non-empty" in res.stderr, res.stderr[-1000:]


def test_flower_binds_loopback_and_guards_every_route(settings_env, tmp_path):
    port = free_port()
    env = {**settings_env, "FLOWER_BASIC_AUTH": "ops:flower-pw"}
    flower = spawn(regen_cmd("flower", "--port", str(port)), env=env, log=tmp_path / "flower.log")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/healthcheck", proc=flower, timeout_s=60)
        assert wait_listening(flower.pid, port) == {"127.0.0.1"}
        for path in ("/metrics", "/api/workers", "/api/tasks", "/", "/tasks", "/workers", "/broker"):
            assert httpx.get(url + path).status_code == 401, path
            assert httpx.get(url + path, auth=("ops", "wrong")).status_code == 401, path
        assert httpx.get(f"{url}/metrics", auth=("ops", "flower-pw")).status_code == 200
        assert httpx.get(f"{url}/api/workers", auth=("ops", "flower-pw")).status_code == 200
        assert httpx.get(f"{url}/healthcheck").text == "OK"  # liveness probes: no data behind it
    finally:
        stop(flower)


def test_worker_metrics_bind_loopback_unless_told(settings_env, tmp_path):
    for extra, expected in (((), {"127.0.0.1"}), (("--metrics-address", "0.0.0.0"), {"0.0.0.0"})):
        port = free_port()
        args = ("--metrics-port", str(port), *extra)
        with worker_process(settings_env, "http://127.0.0.1:9", log=tmp_path / "w.log", extra=args) as w:
            assert wait_listening(w.pid, port) == expected
