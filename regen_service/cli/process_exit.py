"""Ending a finished trainer process without the native teardown that can abort it after the fact.

A process that trained holds native thread pools: Arrow's CPU and I/O pools, gloo's transport, torch's.
At interpreter finalization their static destructors can meet a thread that is still joinable and call
std::terminate, so a process whose work is done and written dies with SIGABRT ("terminate called without
an active exception"), and torchrun reports the whole job failed. Seen here twice: a strict enqueue that
had read a Parquet file (apache/arrow#34314, open; Storage.read_table now decodes on one thread), and on
2026-12-06 rank 0 of a two-rank gloo trainer, after both ranks had torn their process group down and
printed their summaries.

`run_then_exit` runs a click command as its console script would, then does what a normal exit does for
Python code (threading's shutdown: non-daemon threads joined, executors' exit hooks; the atexit handlers:
logging's shutdown, trackers' own; stdio flushed) and leaves with os._exit. Only the native destructors
are skipped. The command's exit status is kept: 0, 1 for a ClickException, 2 for a usage error.
What to run and what to print are the command's; this module owns only the way out.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

import click


def run_then_exit(command: click.Command, args: Sequence[str], prog_name: str) -> NoReturn:
    try:
        command.main(args=list(args), prog_name=prog_name)  # standalone mode: ends by raising SystemExit
        code = 0
    except SystemExit as e:
        code = exit_status(e.code)
    exit_now(code)


def exit_status(code: object) -> int:
    """SystemExit's code as the process status Python itself would give it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
    return 1


def exit_now(code: int) -> NoReturn:
    # The order Py_FinalizeEx keeps: threads first (an executor's workers are woken by its exit hook and
    # joined), then atexit, then the streams.
    shutdown = getattr(threading, "_shutdown", None)  # what the interpreter calls at exit, CPython 3.x
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing more to say on it
            stream.flush()
    os._exit(code)
