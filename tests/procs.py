"""Helpers for tests that run real processes: free ports, the simulator, Celery workers.

Every process is started with `sys.executable -m regen_service.cli ...`-style commands through the
real CLI, so tests exercise what operators run.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from regen_service.localproc import free_port, regen_cmd, stop, wait_http
from regen_service.localproc import spawn as _spawn

__all__ = [
    "free_port",
    "regen_cmd",
    "sim_server",
    "spawn",
    "stop",
    "wait_http",
    "wait_run_done",
    "worker_process",
]

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO.parent / "shared" / "samples"


def spawn(cmd: list[str], env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    return _spawn(cmd, env=env, log=log, cwd=REPO)


@contextlib.contextmanager
def sim_server(*args: str, log: Path | None = None, port: int | None = None) -> Iterator[str]:
    """Run `regen sim --port P ARGS...` and yield its base URL."""
    port = port or free_port()
    proc = spawn(regen_cmd("sim", "--port", str(port), *args), log=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", proc=proc)
        yield url
    finally:
        stop(proc)


@contextlib.contextmanager
def worker_process(
    env: dict, *endpoints: str, log: Path | None = None, extra: tuple[str, ...] = ()
) -> Iterator[subprocess.Popen]:
    """Run `regen worker --endpoint URL...` (a real Celery worker) with the test's settings in env."""
    args = []
    for e in endpoints:
        args += ["--endpoint", e]
    proc = spawn(regen_cmd("worker", *args, *extra), env=env, log=log)
    try:
        yield proc
    finally:
        stop(proc)


def wait_run_done(settings, run_id: str, timeout_s: float = 120.0, procs: tuple = ()) -> dict:
    """Poll the ledger until the run is done; fail fast if a process the test started died."""
    from regen_service.ledger import Ledger
    from regen_service.status import run_status

    ledger = Ledger(settings)
    deadline = time.monotonic() + timeout_s
    st = None
    while time.monotonic() < deadline:
        st = run_status(ledger, run_id)
        if st and st["state"] == "done":
            return st
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a process exited with {p.returncode} while waiting for {run_id}")
        time.sleep(0.3)
    raise TimeoutError(f"run {run_id} not done in {timeout_s}s: {st}")
