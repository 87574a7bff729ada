"""A dead worker's shards back in work with no operator action: the dead-holder sweep.

A SIGKILLed worker leaves its shards as delivered-but-unacknowledged messages in kombu's Redis
transport, which gives them back only once they are older than the visibility timeout (kombu 5.7.0,
kombu/transport/redis.py: `QoS.restore_visible` restores entries of the `unacked_index` sorted set
scored before `time() - visibility_timeout`; 3600 s by default, and it must stay long because a
shorter one redelivers every live worker's long shards too). Its leases expire after lease_ttl_s.

So every worker runs a Sweeper thread, and every `interval_s` one of them (a Redis lock, SET NX PX)
sweeps: a shard the ledger has unfinished (queued or running), that no lease holds, no message in
the queue's lists stands for, and no live worker has in hand (Celery's remote control: active,
reserved and ETA-scheduled requests of every worker that answers), seen so on two sweeps at least
`interval_s` apart (a message between kombu's pop and the worker's books is in neither place for a
moment), is queued again through resume's `queue_unheld`. Exactly once is the lease's and the final
shard's: the copy the visibility timeout redelivers an hour later finds the output and is acked.

Keys (this module's): P:sweep:lock (string, the sweeper's token, expires by itself) and P:sweep:seen
(hash "<run>|<shard>" -> when first seen ownerless).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import redis

from regen_service.settings import Settings
from regen_service.state.ledger import Ledger, owner_node
from regen_service.state.presence import live_workers
from regen_service.state.queue import shard_ref, waiting_shards
from regen_service.state.resume import queue_unheld

log = logging.getLogger(__name__)

UNFINISHED = ("queued", "running")


def sweep_interval_s(settings: Settings) -> float:
    """How often a sweep runs (and how long a shard must stay ownerless): a dead holder's shards are
    back within lease TTL + about three intervals, which stays under a minute past the TTL."""
    return max(2.0, min(15.0, settings.lease_ttl_s / 2))


def shards_in_live_hands(app, expected: int, timeout_s: float = 2.0) -> set[tuple[str, int]]:
    """(run, shard) of every shard task a live worker has received and not finished: running,
    reserved for later, or held until its retry's ETA. Workers that do not answer in time count as
    holding nothing: at worst their shard gets a second message, which the lease makes harmless."""
    insp = app.control.inspect(timeout=timeout_s, limit=expected or None)
    found: set[tuple[str, int]] = set()
    for method in (insp.active, insp.reserved, insp.scheduled):
        for requests in (method() or {}).values():
            for req in requests or ():
                info = req.get("request", req) if isinstance(req, dict) else {}
                ref = shard_ref(info.get("args"))
                if ref is not None:
                    found.add(ref)
    return found


def sweep(settings: Settings, ledger: Ledger, app, now: float | None = None) -> dict[str, list[int]]:
    """One sweep; returns run id -> shards queued again."""
    now = time.time() if now is None else now
    seen_key = f"{settings.key_prefix}:sweep:seen"
    ownerless: set[tuple[str, int]] = set()
    for run_id in ledger.run_ids():
        todo = [sid for sid, st in ledger.shard_states(run_id).items() if st in UNFINISHED]
        if todo:
            held = ledger.leases(run_id, todo)
            ownerless.update((run_id, sid) for sid in todo if sid not in held)
    if ownerless:
        waiting = waiting_shards(settings, ledger.r)
        ownerless = {(r, s) for r, s in ownerless if s not in waiting.get(r, ())}
    if ownerless:
        ownerless -= shards_in_live_hands(app, len(live_workers(settings, ledger.r)))
    first_seen = {k: float(v) for k, v in ledger.r.hgetall(seen_key).items()}
    keys = {f"{r}|{s}": (r, s) for r, s in ownerless}
    due: dict[str, list[int]] = {}
    for key, (run_id, sid) in keys.items():
        if key in first_seen and now - first_seen[key] >= sweep_interval_s(settings):
            due.setdefault(run_id, []).append(sid)
    sent: dict[str, list[int]] = {}
    for run_id, sids in due.items():
        req = queue_unheld(ledger, app, run_id, sorted(sids), covered=())
        if req.sent:
            sent[run_id] = req.sent
            log.warning(
                "shards %s of run %s had no live holder (a worker died): queued again", req.sent, run_id
            )
    pipe = ledger.r.pipeline(transaction=False)
    gone = [k for k in first_seen if k not in keys or keys[k][1] in sent.get(keys[k][0], ())]
    if gone:
        pipe.hdel(seen_key, *gone)
    new = {k: now for k in keys if k not in first_seen}
    if new:
        pipe.hset(seen_key, mapping=new)
    pipe.execute()
    return sent


class Sweeper:
    """A worker's daemon thread: every interval, sweep if no other worker holds the sweep lock."""

    def __init__(self, settings: Settings, app) -> None:
        self.settings = settings
        self.app = app
        self.interval_s = sweep_interval_s(settings)
        self._ledger = Ledger(settings)
        self._token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="regen-sweeper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        lock = f"{self.settings.key_prefix}:sweep:lock"
        # The lock lives a little under one interval, so some worker sweeps every interval, one at a time.
        ttl_ms = int(self.interval_s * 900)
        while not self._stop.wait(self.interval_s):
            try:
                if self._ledger.r.set(lock, self._token, nx=True, px=ttl_ms):
                    sweep(self.settings, self._ledger, self.app)
            except redis.RedisError as e:  # Redis down: the broker connection says so loudly already
                log.debug("sweep skipped: %s", e)
            except Exception:  # a sweep must never end the thread that gives dead workers' shards back
                log.exception("sweep failed; next one in %.0fs", self.interval_s)

    def close(self) -> None:
        self._stop.set()


def dead_holder_shards(
    ledger: Ledger, run_id: str, states: dict[int, str], live_nodes: set[str]
) -> dict[int, str]:
    """Unfinished shards whose holder is gone, with what happens next (for `regen status`): a lease
    held by a worker that is no longer alive, or a running shard whose lease already expired."""
    todo = [sid for sid, st in states.items() if st in UNFINISHED]
    if not todo:
        return {}
    held = ledger.leases(run_id, todo)
    out: dict[int, str] = {}
    for sid in todo:
        if sid in held:
            holder, left_s = held[sid]
            if owner_node(holder) not in live_nodes:
                frees = f"lease frees in {left_s:.0f}s" if left_s is not None else "lease has no TTL"
                out[sid] = f"waiting for dead holder {owner_node(holder)} ({frees}, then back in work)"
        elif states[sid] == "running":
            out[sid] = "holder died, lease expired: the next sweep queues it again"
    return out
