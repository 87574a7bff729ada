"""Helpers for tests that run real processes: free ports, the simulator, Celery workers.

Every process is started with `sys.executable -m regen_service.cli ...`-style commands through the
real CLI, so tests exercise what operators run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO.parent / "shared" / "samples"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def regen_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "from regen_service.cli import main; main()", *args]


def wait_http(url: str, timeout_s: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            r = httpx.get(url, timeout=1.0)
            if r.status_code < 500:
                return
            last = r.status_code
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer in {timeout_s}s (last: {last})")


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def spawn(cmd: list[str], env: dict | None = None, log: Path | None = None) -> subprocess.Popen:
    """Start a process in its own process group (so stop() takes its children too)."""
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(
        cmd,
        env={**os.environ, **(env or {})},
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=REPO,
    )


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
