"""The capacity model: at most R requests decode at once, the rest wait in a FIFO queue.

One tick loop (every `tick_s`) advances every running request by speed * dt tokens, where
speed = decode_tok_s * spec_speedup / (1 + batch_slowdown * (running - 1)), and wakes the
request's stream through its asyncio.Event: no timer per token. A request first waits
prompt_tokens / prefill_tok_s seconds (its TTFT) while holding its slot. Beyond R + Q requests
in the system, `submit` raises QueueFull (the route answers 503). What the tokens are and how they
are sent is left to the routes; instant mode (decode_tok_s == 0) bypasses this module entirely.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from regen_service.sim.config import SimConfig
from regen_service.sim.stats import Stats


class QueueFull(Exception):
    """Running plus queued requests reached max_running_requests + max_queued_requests."""


@dataclass(eq=False)
class Job:
    """One request's decode progress; `k` is the number of tokens available to send."""

    num_stop: int  # tokens to produce before the job ends (the answer's length, or a fault's point)
    prefill_s: float = 0.0
    stall_at: int | None = None
    stall_s: float = 0.0
    k: int = 0
    progress: float = 0.0
    t_decode: float = 0.0  # when decoding may start (admission + prefill)
    t_last: float = 0.0
    paused_until: float = 0.0
    t_submit: float = 0.0
    t_end: float = 0.0  # when the last token was due (inside the tick that noticed it)
    done: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class Scheduler:
    def __init__(self, get_cfg: Callable[[], SimConfig], stats: Stats) -> None:
        self._cfg = get_cfg
        self._stats = stats
        self._running: dict[Job, None] = {}
        self._queue: deque[Job] = deque()
        self._wake = asyncio.Event()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def submit(self, job: Job) -> None:
        cfg = self._cfg()
        job.t_submit = time.monotonic()
        if len(self._running) + len(self._queue) >= cfg.max_running_requests + cfg.max_queued_requests:
            raise QueueFull
        if len(self._running) < cfg.max_running_requests and not self._queue:
            self._start(job, time.monotonic())
        else:
            self._queue.append(job)
        self._report()

    def cancel(self, job: Job) -> None:
        """The client went away or a fault ended the request: free its slot at once."""
        if job.done:
            return
        job.done = True
        if job in self._running:
            del self._running[job]
            self._admit(time.monotonic())
        else:
            with contextlib.suppress(ValueError):  # already left the queue
                self._queue.remove(job)
        self._report()

    def cancel_all(self) -> None:
        """Outage: every request in the system is lost."""
        for job in [*self._running, *self._queue]:
            job.done = True
            job.changed.set()
        self._running.clear()
        self._queue.clear()
        self._report()

    def _start(self, job: Job, now: float) -> None:
        job.t_decode = job.t_last = now + job.prefill_s
        self._running[job] = None
        self._wake.set()

    def _admit(self, now: float) -> None:
        limit = self._cfg().max_running_requests
        while self._queue and len(self._running) < limit:
            self._start(self._queue.popleft(), now)

    def _report(self) -> None:
        self._stats.set_load(len(self._running), len(self._queue))

    async def run(self) -> None:
        while True:
            if not self._running:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(self._cfg().tick_s)
            self.tick(time.monotonic())

    def tick(self, now: float) -> None:
        cfg = self._cfg()
        speed = cfg.per_request_tok_s(len(self._running))
        finished = []
        for job in self._running:
            begin = max(job.t_last, job.t_decode, job.paused_until)
            if now > begin:
                # decode_tok_s set to 0 at runtime: finish what is in flight at once
                job.progress = job.num_stop if speed == 0 else job.progress + speed * (now - begin)
            job.t_last = now
            k = min(job.num_stop, int(job.progress))
            if job.stall_at is not None and k >= job.stall_at:
                k = job.stall_at
                job.progress = float(k)
                job.paused_until = now + job.stall_s
                job.stall_at = None
                self._stats.num_stalls_injected += 1
            if k > job.k:
                self._stats.add_tokens(k - job.k)
                job.k = k
                job.changed.set()
            if k >= job.num_stop and now >= job.paused_until:
                # the moment the last token was due, not the tick that noticed it
                overshoot = (job.progress - job.num_stop) / speed if speed > 0 else 0.0
                job.t_end = max(begin, now - overshoot)
                finished.append(job)
        for job in sorted(finished, key=lambda j: j.t_end):
            job.done = True
            job.changed.set()
            del self._running[job]
            # Continuous batching admits the next request at the decode step after a slot frees, which is
            # far finer than this tick: start it when the slot freed (or when it arrived, if later), so the
            # tick length costs no capacity.
            if self._queue and len(self._running) < cfg.max_running_requests:
                nxt = self._queue.popleft()
                self._start(nxt, max(job.t_end, nxt.t_submit))
        if finished:
            self._admit(now)
            self._report()
