"""Run the quality matrix's cells as child processes, several at once on one GPU.

A draft of a small target is launch-bound: one training process leaves most of an H200 idle, so the
benchmark runs `num_jobs` cells at a time, each in a process of its own (the same script with
`--only KEY`), which loads the shared work folder and appends its one result line. The results
file is the record: a cell whose key is in it is not run again, so a call that stops at its deadline
resumes where it stopped. A child that fails leaves an `error` line with its exit status and the
tail of its log (nothing is lost silently); a deadline stops new launches, never a running child.
What a cell does is matrix.py's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class Results:
    """JSON lines to stdout and a file shared by the children: one write per line, in append mode."""

    def __init__(self, path: Path):
        self.path = path

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    @property
    def done(self) -> set[str]:
        return {r["key"] for r in self.read() if "key" in r}

    def emit(self, rec: dict, echo: bool = True) -> None:
        line = json.dumps(rec, default=str) + "\n"
        if echo:
            print(line, end="", flush=True)
        # one write(2) on an O_APPEND descriptor: concurrent children never interleave inside a line
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def run_children(
    keys: list[str], child_argv: list[str], num_jobs: int, results: Results, logs: Path, deadline_at: float
) -> dict[str, int]:
    """Run `child_argv + ["--only", key]` for each key, `num_jobs` at a time; -> {key: exit status}."""
    logs.mkdir(parents=True, exist_ok=True)
    pending, running, status = list(keys), {}, {}
    # a parent stopped by its caller's timeout takes its children with it, instead of leaving them on the GPU
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        _drive(pending, running, status, child_argv, num_jobs, results, logs, deadline_at)
    finally:
        for proc, log, _ in running.values():
            proc.kill()
            log.close()
        signal.signal(signal.SIGTERM, before)
    if pending:
        results.emit({"stage": "stopped", "reason": "deadline", "not_started": pending})
    return status


def _drive(pending, running, status, child_argv, num_jobs, results, logs, deadline_at) -> None:
    # CPU threads shared out, so that num_jobs children do not each start one per core
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // num_jobs))}
    while pending or running:
        while pending and len(running) < num_jobs and time.time() < deadline_at:
            key = pending.pop(0)
            log = open(logs / f"{key}.log", "wb")  # noqa: SIM115 - closed when the child ends
            proc = subprocess.Popen(
                [sys.executable, *child_argv, "--only", key], stdout=log, stderr=subprocess.STDOUT, env=env
            )
            running[key] = (proc, log, time.time())
        if pending and time.time() >= deadline_at and not running:
            break
        time.sleep(1.0)
        for key, (proc, log, t0) in list(running.items()):
            rc = proc.poll()
            if rc is None:
                continue
            log.close()
            del running[key]
            status[key] = rc
            if rc != 0 and key not in results.done:
                tail = (logs / f"{key}.log").read_bytes()[-3000:].decode(errors="replace")
                results.emit({"key": key, "error": f"child exited {rc}", "log_tail": tail,
                              "wall_s": round(time.time() - t0, 1)})  # fmt: skip
            else:
                for rec in results.read():  # echo the child's line to this process's stdout
                    if rec.get("key") == key:
                        print(json.dumps(rec, default=str), flush=True)
