"""The trainer's way out (regen_service/cli/process_exit.py), in real processes: what a normal exit does for
Python code still happens (the printed summary, atexit handlers, an executor's pending work, the exit
status), and a teardown that aborts the process once its work is done no longer runs. The abort is played
by an object whose finalizer calls os.abort() when the interpreter clears module globals at exit, where
Arrow's and gloo's native destructors run."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.procs

PROGRAM = textwrap.dedent(
    """
    import atexit, os, sys, time
    from concurrent.futures import ThreadPoolExecutor
    import click
    from regen_service.cli.process_exit import run_then_exit

    class TornDownBadly:
        def __del__(self):  # runs at interpreter finalization, as native pools' destructors do
            os.abort()

    OUT = sys.argv[1]
    pool = ThreadPoolExecutor(1)

    @click.command()
    @click.argument("how")
    def cmd(how):
        global keep
        keep = TornDownBadly()
        atexit.register(lambda: open(OUT + ".atexit", "w").write("ran"))
        pool.submit(lambda: (time.sleep(0.3), open(OUT + ".task", "w").write("done")))
        print('{"steps": 18}')  # stdout is a pipe: block-buffered, written only if flushed
        if how == "fail":
            raise click.ClickException("shards [2] were never announced")

    if sys.argv[2] == "plain":
        cmd.main(args=sys.argv[3:], prog_name="t")
    else:
        run_then_exit(cmd, sys.argv[3:], "t")
    """
)


def _run(tmp_path: Path, mode: str, *args: str) -> subprocess.CompletedProcess:
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    out = tmp_path / mode
    return subprocess.run(
        [sys.executable, str(prog), str(out), mode, *args], capture_output=True, text=True, timeout=60
    )


def test_a_finished_command_exits_0_with_its_output_and_exit_handlers_even_if_teardown_would_abort(tmp_path):
    plain = _run(tmp_path, "plain", "ok")
    assert plain.returncode == -6, "the stand-in for a native teardown abort must abort a normal exit"

    done = _run(tmp_path, "exit", "ok")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == '{"steps": 18}'
    assert (tmp_path / "exit.atexit").read_text() == "ran"
    assert (tmp_path / "exit.task").read_text() == "done", "work submitted to an executor finishes first"


def test_the_commands_own_failures_keep_their_status_and_message(tmp_path):
    failed = _run(tmp_path, "exit", "fail")
    assert failed.returncode == 1
    assert failed.stdout.strip() == '{"steps": 18}'
    assert "Error: shards [2] were never announced" in failed.stderr
    assert (tmp_path / "exit.atexit").read_text() == "ran"

    usage = _run(tmp_path, "exit")  # the argument missing
    assert usage.returncode == 2
    assert "Missing argument 'HOW'" in usage.stderr
