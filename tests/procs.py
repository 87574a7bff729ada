"""Helpers for tests that run real processes: free ports, the simulator, Celery workers.

Every process is started with `sys.executable -m regen_service.cli ...`-style commands through the
real CLI, so tests exercise what operators run.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from regen_service.localproc import free_port, regen_cmd, stop, wait_http
from regen_service.localproc import spawn as _spawn

__all__ = [
    "engine_python",
    "free_port",
    "regen_cmd",
    "sim_server",
    "spawn",
    "stop",
    "vllm_server",
    "wait_http",
    "wait_run_done",
    "worker_process",
]

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO.parent / "shared" / "samples"
ENGINE_VENV_PYTHON = REPO / ".venv-engine" / "bin" / "python"


def engine_python() -> str:
    """The python of the vLLM environment (`make engine`), or REGEN_VLLM_PYTHON. Without one the engine
    tests skip, except under CI (or REGEN_REQUIRE_ENGINE=1), where a missing engine is a failure."""
    import pytest

    exe = os.environ.get("REGEN_VLLM_PYTHON") or str(ENGINE_VENV_PYTHON)
    if Path(exe).is_file():
        return exe
    why = f"no vLLM environment at {exe}: run `make engine` (or set REGEN_VLLM_PYTHON)"
    if os.environ.get("CI") or os.environ.get("REGEN_REQUIRE_ENGINE"):
        pytest.fail(why)
    pytest.skip(why)


@contextlib.contextmanager
def vllm_server(target: Path, log: Path, **spec) -> Iterator[str]:
    """A real vLLM OpenAI server for `target` (a tiny local model), built by regen's own launcher
    (`regen launch-vllm`): plain, with draft=DIR, or with hidden_states_dir=DIR. Yields its base URL."""
    from regen_service.deploy.launch_vllm import VllmLaunchSpec, build_vllm_launch

    port = free_port()
    launch = build_vllm_launch(
        VllmLaunchSpec(
            target=str(target), served_model_name="tiny", python=engine_python(), port=port,
            max_model_len=1024, dtype="bfloat16", extra=["--enforce-eager"], **spec,
        )
    )  # fmt: skip
    # 1 GiB of KV cache is plenty for the tiny targets and keeps two servers within the CI machine.
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", **launch.env}
    proc = spawn(launch.argv, env=env, log=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", timeout_s=420, proc=proc)
        yield url
    finally:
        stop(proc, timeout_s=30)


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
    from regen_service.state.ledger import Ledger
    from regen_service.state.status import run_status

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
