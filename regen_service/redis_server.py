"""A private redis-server, started and stopped by this process: for `regen demo` on a machine where no
Redis answers, and for tests that must restart, reconfigure or fill a Redis (never the shared one).

It runs in the foreground as our child (its own process group), on a free 127.0.0.1 port, with its
files in `dir_`; extra arguments are redis-server's own (`--appendonly yes`, `--requirepass`,
`--tls-port`, `--maxmemory`...). Which server a command talks to is still Settings' redis_url.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis

from regen_service.errors import ConfigError
from regen_service.localproc import free_port, spawn, stop

INSTALL_HINT = (
    "apt-get install -y redis-server (Debian/Ubuntu), dnf install redis (Fedora), brew install redis (macOS)"
)


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


class PrivateRedis:
    """One redis-server process; `restart()` keeps its port, directory and arguments (AOF included)."""

    def __init__(self, dir_: Path, *args: str, port: int | None = None, client_kwargs: dict | None = None):
        exe = redis_server_binary()
        if exe is None:
            raise ConfigError(f"no redis-server on PATH: install one with {INSTALL_HINT}")
        self.exe, self.dir, self.args = exe, Path(dir_), list(args)
        self.port = port or free_port()
        self.client_kwargs = client_kwargs or {}
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 30.0) -> None:
        base = ["--bind", "127.0.0.1", "--dir", str(self.dir), "--save", ""]
        if "--port" not in self.args:
            base += ["--port", str(self.port)]
        self.proc = spawn([self.exe, *base, *self.args], log=self.dir / "redis.log", cwd=self.dir)
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1, **self.client_kwargs)
        while True:
            try:
                client.ping()
                return
            except redis.BusyLoadingError:
                pass  # replaying its AOF: up soon
            except redis.AuthenticationError:
                return  # it answers; the caller knows the password
            except redis.RedisError:
                if self.proc.poll() is not None:
                    log = (self.dir / "redis.log").read_text(errors="replace")[-500:]
                    raise ConfigError(f"redis-server exited ({self.proc.returncode}): {log}") from None
            if time.monotonic() > deadline:
                raise ConfigError(f"redis-server on port {self.port} did not answer in {timeout_s:.0f}s")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM: Redis's own shutdown (AOF flushed); SIGKILL: a crash."""
        if self.proc is not None:
            stop(self.proc, sig=sig)
            self.proc = None

    def restart(self, sig: int = signal.SIGTERM) -> None:
        self.stop(sig)
        self.start()


@contextlib.contextmanager
def private_redis(dir_: Path, *args: str, **kwargs) -> Iterator[PrivateRedis]:
    server = PrivateRedis(dir_, *args, **kwargs)
    try:
        yield server
    finally:
        server.stop()
