"""How many shards a worker holds: another one whenever the prompts in hand cannot fill its budget.

A fixed number of shards in parallel leaves servers idle when every held shard drains its long tail at
once, and is far too few for endpoints that run hundreds of requests each. So the worker's Celery
prefetch count is driven from here: it is the number of shards being worked on, plus enough spare
shards (at the mean shard size seen) to bring the prompts in hand to twice the in-flight budget while
they are fewer (the next shard must arrive before the slots run dry). `max_shards` (Celery's thread count) and `max_prompts`
bound what a worker holds in memory.

Celery applies a prefetch change from its consumer loop (kombu's QoS "eventually" calls, made for
other threads), and its own ETA-task adjustments are relative too, so this module only ever moves
the count by the difference between what it wants now and what it asked for last.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable

from celery import bootsteps

log = logging.getLogger(__name__)


class Intake:
    def __init__(self, max_shards: int, max_prompts: int, inflight_target: Callable[[], int]) -> None:
        self.max_shards = max_shards
        self.max_prompts = max_prompts
        self._inflight_target = inflight_target
        self._lock = threading.Lock()
        self.num_shards = 0  # shards started and not finished
        self.num_waiting = 0  # prompts of those shards not answered yet
        self._qos = None
        self._granted = 0
        self._shards_seen = 0
        self._prompts_seen = 0

    # --- what the shards report (Celery threads and the event loop) -----------------------------
    def shard_started(self, num_prompts: int) -> None:
        with self._lock:
            self.num_shards += 1
            self.num_waiting += num_prompts
            self._shards_seen += 1
            self._prompts_seen += num_prompts
            self._apply()

    def prompt_answered(self) -> None:
        with self._lock:
            self.num_waiting -= 1
            self._apply()

    def shard_finished(self, num_unanswered: int) -> None:
        with self._lock:
            self.num_shards -= 1
            self.num_waiting -= num_unanswered
            self._apply()

    # --- the decision --------------------------------------------------------------------------
    def hungry(self) -> bool:
        """True while the prompts in hand would leave in-flight slots empty before a shard arrives."""
        budget = max(1, self._inflight_target())
        # `num_waiting` includes the prompts in flight: another budget's worth waiting is the headroom
        # that covers fetching and reading the next shard.
        return self.num_waiting < 2 * budget and self.num_waiting < self.max_prompts

    def wanted(self) -> int:
        spare = 0
        if self.hungry():
            # As many shards as cover the shortfall, at the shard size seen so far: Celery applies a new
            # prefetch count only on its next loop turn (up to a second), so asking one shard at a time
            # would ramp a worker with hundreds of slots up one turn per shard.
            target = min(2 * max(1, self._inflight_target()), self.max_prompts)
            mean_shard = self._prompts_seen / self._shards_seen if self._shards_seen else 0
            spare = max(1, math.ceil((target - self.num_waiting) / mean_shard)) if mean_shard else 1
        return max(1, min(self.max_shards, self.num_shards + spare))

    def attach(self, qos) -> None:
        """Take over the consumer's prefetch count (Celery started it at max_shards)."""
        with self._lock:
            self._qos = qos
            self._granted = qos.value
            self._apply()
            log.info("shard intake by in-flight budget: prefetch %d (at most %d shards, %d prompts in hand)",
                     self._granted, self.max_shards, self.max_prompts)  # fmt: skip

    def _apply(self) -> None:
        if self._qos is None:
            return
        want = self.wanted()
        delta = want - self._granted
        if delta > 0:
            self._qos.increment_eventually(delta)
        elif delta < 0:
            self._qos.decrement_eventually(-delta)
        self._granted = want

    def snapshot(self) -> dict:
        with self._lock:
            return {"shards": self.num_shards, "prompts_waiting": self.num_waiting, "prefetch": self._granted}


class IntakeStep(bootsteps.StartStopStep):
    """A consumer bootstep: once Celery has set up its prefetch count, hand it to the worker's Intake."""

    requires = ("celery.worker.consumer.tasks:Tasks",)
    intake: Intake | None = None  # set by regen_service.work.worker_app before the worker starts

    def start(self, c) -> None:
        if self.intake is not None and c.qos is not None:
            self.intake.attach(c.qos)
            c.qos.update()  # apply at once: the first fetch takes one shard, not max_shards
            if getattr(c, "hub", None) is not None:
                # Celery's loop applies a changed prefetch count between polls, and polls up to a second
                # when idle: a 0.1 s timer bounds how late the next shard is asked for.
                c.hub.call_repeatedly(0.1, _noop)


def _noop() -> None:
    pass
