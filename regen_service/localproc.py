"""Running regen's own processes on this machine: the demo, the tests and the benchmarks start the
simulator and workers through the real CLI with these helpers, each in its own process group so that
stopping it takes its children too."""

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def regen_cmd(*args: str) -> list[str]:
    """`regen ARGS...` with this interpreter, whether or not the console script is on PATH."""
    return [sys.executable, "-c", "from regen_service.cli import main; main()", *args]


def spawn(
    cmd: list[str], env: dict | None = None, log: Path | None = None, cwd: Path | None = None
) -> subprocess.Popen:
    """Start a process in its own process group, output appended to `log` (or discarded)."""
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        cmd,
        env={**os.environ, **(env or {})},
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=cwd,
    )


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


def wait_http(url: str, timeout_s: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Wait until `url` answers below 500; fail early if `proc` exits first."""
    deadline = time.monotonic() + timeout_s
    last: object = None
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


@contextlib.contextmanager
def simulators(arg_lists: list[list[str]], timeout_s: float = 30.0) -> Iterator[list[str]]:
    """One `regen sim` per argument list, each on a free port with its output discarded; yields their
    URLs once every one answers /health, and stops them all on exit (the benchmarks' simulator fleet)."""
    procs: list[subprocess.Popen] = []
    urls: list[str] = []
    try:
        for args in arg_lists:
            port = free_port()
            procs.append(spawn(regen_cmd("sim", "--port", str(port), *args)))
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(procs, urls, strict=True):
            wait_http(f"{url}/health", timeout_s=timeout_s, proc=proc)
        yield urls
    finally:
        for proc in procs:
            stop(proc)
