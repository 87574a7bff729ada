"""Helpers for tests that run real processes: free ports, the simulator, Celery workers.

Every process is started with `sys.executable -m regen_service.cli ...`-style commands through the
real CLI, so tests exercise what operators run.

Waits are progress-based (`wait_progress`): a wait fails when what it watches (a run's counters, a
process's log and CPU time) has not moved for its window, not when a fixed clock runs out, so a loaded
2-core machine that is slow but moving never fails a test; an overall cap, far above any run's real
length, still ends a wait that moves forever without finishing. A failure says what was last seen.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil

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
    "wait_exit",
    "wait_http",
    "wait_progress",
    "wait_run_done",
    "wait_up",
    "worker_process",
]

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO.parent / "shared" / "samples"
ENGINE_VENV_PYTHON = REPO / ".venv-engine" / "bin" / "python"


def settings_env_of(settings) -> dict[str, str]:
    """A test's settings as the environment variables the processes it starts read."""
    return {
        "REGEN_REDIS_URL": settings.redis_url,
        "REGEN_DATA_ROOT": settings.data_root,
        "REGEN_KEY_PREFIX": settings.key_prefix,
        "REGEN_LEASE_TTL_S": str(settings.lease_ttl_s),
        "REGEN_HEARTBEAT_S": str(settings.heartbeat_s),
        "REGEN_VISIBILITY_TIMEOUT_S": str(settings.visibility_timeout_s),
    }


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
        # vLLM logs as it loads; 420 s without a new log line or CPU time is a hung server
        wait_up(f"{url}/health", proc, log=log, stall_s=420, cap_s=1800)
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
        wait_up(f"{url}/health", proc, log=log, stall_s=60)
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


def wait_progress(
    probe: Callable[[], tuple[bool, object]],
    *,
    what: str,
    stall_s: float,
    cap_s: float | None = None,
    procs: tuple = (),
    interval_s: float = 0.3,
):
    """Poll `probe()` -> (done, seen) until done; returns the last `seen`.

    Fails (TimeoutError) when `seen` has not changed for `stall_s` seconds, or after `cap_s` in all
    (default: ten windows, at least 15 minutes); RuntimeError at once if a process in `procs` exited.
    The message says what was last seen and how long ago it last changed.
    """
    cap_s = cap_s if cap_s is not None else max(10 * stall_s, 900.0)
    t0 = time.monotonic()
    changed_at, seen, first = t0, None, True
    while True:
        done, now_seen = probe()
        now = time.monotonic()
        if done:
            return now_seen
        if first or now_seen != seen:
            changed_at, seen, first = now, now_seen, False
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(
                    f"a process exited with {p.returncode} while waiting for {what}; last seen: {seen}"
                )
        if now - changed_at > stall_s:
            raise TimeoutError(
                f"{what}: no progress for {now - changed_at:.0f}s (window {stall_s:.0f}s, "
                f"{now - t0:.0f}s in all); last seen: {seen}"
            )
        if now - t0 > cap_s:
            raise TimeoutError(
                f"{what}: still moving but not done after the {cap_s:.0f}s cap; last seen: {seen}"
            )
        time.sleep(interval_s)


def _activity(proc: subprocess.Popen, log: Path | None) -> tuple:
    """What a starting process shows of being alive: its log's size and its CPU time (children too)."""
    size = log.stat().st_size if log is not None and log.exists() else 0
    try:
        ps = psutil.Process(proc.pid)
        cpu = sum(sum(p.cpu_times()[:2]) for p in (ps, *ps.children(recursive=True)))
    except psutil.Error:
        cpu = None
    # CPU time in 1 s steps: a process idling in a poll loop does not count as moving
    return size, None if cpu is None else int(cpu)


def wait_up(url: str, proc: subprocess.Popen, log: Path | None = None, stall_s: float = 60.0,
            cap_s: float | None = None) -> None:  # fmt: skip
    """Wait until `url` answers below 500 while `proc` (which serves it) is still starting: fails when
    its log and CPU time stand still for `stall_s`, or it exits."""
    last: list = [None]

    def probe():
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code < 500:
                return True, None
            last[0] = r.status_code
        except httpx.HTTPError as e:
            last[0] = type(e).__name__
        return False, _activity(proc, log)

    try:
        wait_progress(probe, what=f"{url} to answer", stall_s=stall_s, cap_s=cap_s, procs=(proc,))
    except TimeoutError as e:
        raise TimeoutError(f"{e} (last answer: {last[0]}; log: {log})") from None


def wait_exit(proc: subprocess.Popen, log: Path | None = None, stall_s: float = 180.0,
              cap_s: float | None = None) -> int:  # fmt: skip
    """Wait for `proc` to exit and return its code; fails when its log and CPU time stand still for
    `stall_s` (a hung process), never merely because a loaded machine made it slow."""

    def probe():
        code = proc.poll()
        return code is not None, (code if code is not None else _activity(proc, log))

    return wait_progress(probe, what=f"process {proc.pid} to exit", stall_s=stall_s, cap_s=cap_s)


def wait_run_done(settings, run_id: str, timeout_s: float = 120.0, procs: tuple = (), *,
                  cap_s: float | None = None) -> dict:  # fmt: skip
    """Poll the ledger until the run is done; fail fast if a process the test started died.

    `timeout_s` is the window without progress (prompts, shards, tokens, state all unchanged) after
    which the run counts as stuck; a run that keeps moving may take up to `cap_s` (default: ten windows,
    at least 15 minutes). The failure shows the last status seen.
    """
    from regen_service.state.ledger import Ledger
    from regen_service.state.status import run_status

    ledger = Ledger(settings)
    keys = ("state", "prompts_done", "prompts_failed", "shards_done", "shards_failed", "tokens_generated")
    last: list = [None]

    def probe():
        st = run_status(ledger, run_id)
        last[0] = st
        if st and st["state"] == "done":
            return True, st
        return False, None if not st else tuple(st.get(k) for k in keys)

    try:
        return wait_progress(
            probe, what=f"run {run_id} to be done", stall_s=timeout_s, cap_s=cap_s, procs=procs
        )
    except TimeoutError as e:
        raise TimeoutError(f"{e}; status: {last[0]}") from None
