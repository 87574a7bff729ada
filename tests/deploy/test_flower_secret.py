"""Issue 18, item 9: `regen flower --basic-auth user:pass` showed the password in `ps`. The credentials
now come from a file (`--basic-auth-file`, a Docker secret) or FLOWER_BASIC_AUTH and reach Flower through
its environment; the real Flower process's /proc/<pid>/cmdline (and its children's) never holds them.
`--basic-auth` still works and says, on stderr, that `ps` shows it."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import httpx
import psutil

from tests.procs import free_port, regen_cmd, spawn, stop, wait_http


def _cmdlines(pid: int) -> list[bytes]:
    """What `ps` shows for the process and every process under it, read from /proc as any user can."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return [Path(f"/proc/{p.pid}/cmdline").read_bytes() for p in procs]


def _serve(args: list[str], env: dict, log: Path):
    port = free_port()
    proc = spawn(regen_cmd("flower", "--port", str(port), *args), env=env, log=log)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/healthcheck", proc=proc, timeout_s=90)
    return proc, url


def test_password_from_a_file_is_in_no_command_line_nor_the_exec_environment(settings_env, tmp_path):
    password = f"file-pw-{uuid.uuid4().hex}"
    secret = tmp_path / "flower_basic_auth"
    secret.write_text(f"ops:{password}\n")  # a trailing newline, as `echo ... > file` writes it
    secret.chmod(0o600)
    # an older value in the environment loses to the file the operator named
    env = {**settings_env, "FLOWER_BASIC_AUTH": "old:stale-pw"}
    log = tmp_path / "flower.log"
    proc, url = _serve(["--basic-auth-file", str(secret)], env, log)
    try:
        lines = _cmdlines(proc.pid)
        assert any(b"flower" in c for c in lines)
        assert not any(password.encode() in c for c in lines), lines
        assert password.encode() not in Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert httpx.get(f"{url}/api/workers").status_code == 401
        assert httpx.get(f"{url}/api/workers", auth=("old", "stale-pw")).status_code == 401
        assert httpx.get(f"{url}/api/workers", auth=("ops", password)).status_code == 200
        assert httpx.get(f"{url}/metrics", auth=("ops", password)).status_code == 200
    finally:
        stop(proc)
    assert password not in log.read_text()


def test_password_from_the_environment_is_in_no_command_line(settings_env, tmp_path):
    password = f"env-pw-{uuid.uuid4().hex}"
    proc, url = _serve([], {**settings_env, "FLOWER_BASIC_AUTH": f"ops:{password}"}, tmp_path / "f.log")
    try:
        assert not any(password.encode() in c for c in _cmdlines(proc.pid))
        assert httpx.get(f"{url}/api/workers").status_code == 401
        assert httpx.get(f"{url}/api/workers", auth=("ops", password)).status_code == 200
    finally:
        stop(proc)


def test_basic_auth_flag_still_works_and_warns_it_shows_in_ps(settings_env, tmp_path):
    password = f"argv-pw-{uuid.uuid4().hex}"
    log = tmp_path / "flower.log"
    proc, url = _serve(["--basic-auth", f"ops:{password}"], settings_env, log)
    try:
        # the operator's own argv holds it (that is what the warning is about); nothing Flower starts does
        own, *children = _cmdlines(proc.pid)
        assert password.encode() in own and not any(password.encode() in c for c in children)
        assert httpx.get(f"{url}/api/workers", auth=("ops", password)).status_code == 200
        assert httpx.get(f"{url}/api/workers").status_code == 401
    finally:
        stop(proc)
    text = log.read_text()
    assert "warning: --basic-auth puts the password in this process's command line" in text
    assert "--basic-auth-file" in text


def test_bad_credential_files_are_one_line_errors(settings_env, tmp_path):
    env = {**os.environ, **settings_env}
    env.pop("FLOWER_BASIC_AUTH", None)
    two_lines = tmp_path / "two"
    two_lines.write_text("ops:pw\nother:pw\n")
    empty_pw = tmp_path / "empty"
    empty_pw.write_text("ops:\n")
    cases = [
        (["--basic-auth-file", str(tmp_path / "missing")], "--basic-auth-file", "cannot read it"),
        (["--basic-auth-file", str(two_lines)], "expected one line user:password", "several lines"),
        (["--basic-auth-file", str(empty_pw)], "both parts non-empty", "--basic-auth-file"),
        (["--basic-auth", "ops:pw", "--basic-auth-file", str(empty_pw)], "not both", "--basic-auth-file"),
        ([], "--basic-auth-file PATH", "FLOWER_BASIC_AUTH"),
    ]
    for args, *needles in cases:
        res = subprocess.run(regen_cmd("flower", "--port", str(free_port()), *args), capture_output=True,
                             text=True, env=env, timeout=120)  # fmt: skip
        assert res.returncode != 0, args
        assert all(n in res.stderr for n in needles), (args, res.stderr[-1500:])
        assert "Traceback" not in res.stderr and "pw\n" not in res.stderr, res.stderr[-1500:]
