"""Which workers are alive and whether they can serve: one short-lived Redis hash per worker.

A worker refreshes `{prefix}:worker:{node}` every heartbeat with its state ("consuming", or
"no_endpoint" with the reason and since when); the key expires after a few missed heartbeats, so a
dead worker disappears by itself (a sorted set lists the keys, so nothing scans the keyspace). `regen status` reads them to say "no live consumer" instead of
showing a run that silently makes no progress. What a worker does about a missing endpoint is
regen_service.work.worker_app's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import redis

from regen_service.settings import Settings
from regen_service.state.ledger import connect

log = logging.getLogger(__name__)


def worker_key(settings: Settings, node: str) -> str:
    return f"{settings.key_prefix}:worker:{node}"


class Presence:
    """Refreshes this worker's hash from a daemon thread; the fields are plain strings."""

    def __init__(self, settings: Settings, node: str, endpoints: list[str]) -> None:
        self.settings = settings
        self.key = worker_key(settings, node)
        self._r = connect(settings)
        self._fields = {"node": node, "endpoints": " ".join(endpoints), "state": "consuming",
                        "since": str(time.time()), "reason": ""}  # fmt: skip
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="regen-presence", daemon=True)
        self._thread.start()

    def set_state(self, state: str, reason: str = "") -> None:
        with self._lock:
            if self._fields["state"] != state:
                self._fields["since"] = str(time.time())
            self._fields.update(state=state, reason=reason)
        self._write()

    def _write(self) -> None:
        with self._lock:
            fields = dict(self._fields)
        ttl_s = max(10, int(3 * self.settings.heartbeat_s))
        try:
            pipe = self._r.pipeline(transaction=True)
            pipe.hset(self.key, mapping=fields)
            pipe.expire(self.key, ttl_s)
            pipe.zadd(workers_key(self.settings), {self.key: time.time()})
            pipe.execute()
        except redis.RedisError as e:  # the broker connection reports Redis outages loudly already
            log.debug("presence not written: %s", e)

    def _run(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_s):
            self._write()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(redis.RedisError):
            self._r.delete(self.key)
            self._r.zrem(workers_key(self.settings), self.key)


def workers_key(settings: Settings) -> str:
    """A sorted set of worker keys by last refresh: status reads it instead of scanning the keyspace."""
    return f"{settings.key_prefix}:workers"


def live_workers(settings: Settings, client: redis.Redis) -> list[dict]:
    """Every worker whose hash has not expired (refreshed within the last few heartbeats)."""
    zkey = workers_key(settings)
    client.zremrangebyscore(zkey, "-inf", time.time() - 3600)  # long gone: keep the set small
    keys = client.zrange(zkey, 0, -1)
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.hgetall(key)
    out = [fields for fields in pipe.execute() if fields]
    return sorted(out, key=lambda w: w.get("node", ""))
