"""The run's shard_done stream, read through a Redis consumer group so no shard is trained twice.

Exactly-once across kills and several trainers rests on four rules:
- an entry is XACKed only after a checkpoint that lists its shard as consumed was written;
- a (re)started trainer first takes its own pending entries (same consumer name: by default derived
  from the output directory), acks those its checkpoint already lists and re-trains the others;
- entries another consumer left pending longer than `claim_idle_s` are taken over (XAUTOCLAIM);
- while training, a keepalive thread re-claims our own pending entries (only those still ours,
  checked in one Lua call), so a live but slow trainer's shard is never taken over.
New entries are read one at a time, when the trainer is ready for them, so trainers sharing a
group split the run fairly. The training itself, and which shards count as consumed, is train.py's.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
from dataclasses import dataclass

import pydantic
import redis

from regen_service.state.ledger import Ledger, read_shard_done

log = logging.getLogger(__name__)

# Re-claim (resetting idle time) each given id that is still pending for this consumer.
_KEEPALIVE = """
local out = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    table.insert(out, ARGV[i])
  end
end
return out
"""


@dataclass(frozen=True)
class ShardRef:
    entry_id: str
    run_id: str
    shard_id: int
    path: str
    num_rows: int

    @property
    def key(self) -> tuple[str, int]:
        return (self.run_id, self.shard_id)


def default_consumer_name(out_dir: str) -> str:
    """Stable across restarts of the trainer writing `out_dir` on this host, so it finds its pending."""
    digest = hashlib.sha1(str(out_dir).encode()).hexdigest()[:10]
    return f"trainer-{socket.gethostname()}-{digest}"


class ShardFeed:
    def __init__(
        self,
        ledger: Ledger,
        run_id: str,
        group: str = "trainer",
        consumer: str = "trainer",
        claim_idle_s: float = 600.0,
        poll_s: float = 2.0,
    ):
        self.ledger, self.r, self.run_id = ledger, ledger.r, run_id
        self.key = ledger.events_key(run_id)
        self.group, self.consumer = group, consumer
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self.poll_s = poll_s
        self.queue: list[ShardRef] = []
        self.held: dict[str, ShardRef] = {}  # delivered to us, not acked
        self._lock = threading.Lock()
        self._started_pending = False
        self.lost: set[str] = set()  # entries taken over by another consumer while we held them
        self._keepalive = self.r.register_script(_KEEPALIVE)
        self._stop = threading.Event()
        try:
            self.r.xgroup_create(self.key, group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._thread = threading.Thread(target=self._keepalive_loop, daemon=True, name="shard-keepalive")
        self._thread.start()

    # --- entries ------------------------------------------------------------------------------------
    def _take(self, entries) -> list[ShardRef]:
        refs, other = [], []
        for entry_id, fields in entries:
            ref = self._ref(entry_id, fields)
            if ref is not None:
                refs.append(ref)
            else:  # run_done, deleted or malformed entries, anything else: nothing to train
                other.append(entry_id)
        if other:
            self.r.xack(self.key, self.group, *other)
        with self._lock:
            for ref in refs:
                self.held[ref.entry_id] = ref
        return refs

    def _ref(self, entry_id: str, fields: dict | None) -> ShardRef | None:
        """A shard_done entry of our run as a ShardRef; None for anything else. Its `path` is kept
        for the record only: the trainer finds the file from (run, shard) under its own data root."""
        try:
            event = read_shard_done(fields or {})
        except pydantic.ValidationError as e:
            why = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            log.error(
                "stream entry %s of run %s is no valid shard_done event; skipped (%s)",
                entry_id,
                self.run_id,
                why,
            )
            return None
        if event is None or event.run_id != self.run_id:
            return None
        return ShardRef(entry_id, event.run_id, event.shard_id, event.path, event.num_rows)

    def _own_pending(self) -> list[ShardRef]:
        out, last = [], "0"
        while True:
            resp = self.r.xreadgroup(self.group, self.consumer, {self.key: last}, count=100)
            entries = resp[0][1] if resp else []
            if not entries:
                return out
            last = entries[-1][0]
            out += self._take(entries)

    def _claim_stale(self) -> list[ShardRef]:
        out, start = [], "0-0"
        while True:
            resp = self.r.xautoclaim(
                self.key, self.group, self.consumer, self.claim_idle_ms, start_id=start, count=50
            )
            start, entries = resp[0], resp[1]
            out += self._take([e for e in entries if e is not None])
            if start in ("0-0", b"0-0"):
                return out

    def _read_new(self, block_ms: int | None) -> list[ShardRef]:
        resp = self.r.xreadgroup(self.group, self.consumer, {self.key: ">"}, count=1, block=block_ms)
        return self._take(resp[0][1]) if resp else []

    def _refill(self, block_ms: int | None) -> None:
        if not self._started_pending:
            self.queue += self._own_pending()
            self._started_pending = True
        if not self.queue:
            self.queue += self._claim_stale()
        if not self.queue:
            self.queue += self._read_new(block_ms)

    def next(self, follow: bool) -> ShardRef | None:
        """The next shard to train, or None once there is none (now; with follow: ever)."""
        while True:
            finished = follow and self.run_finished()  # observed BEFORE the read below
            self._refill(None)
            if self.queue:
                return self.queue.pop(0)
            if not follow:
                return None
            if finished and self._others_pending() == 0:
                return None
            self._refill(int(self.poll_s * 1000))
            if self.queue:
                return self.queue.pop(0)

    # --- run state ----------------------------------------------------------------------------------
    def run_finished(self) -> bool:
        last = self.r.xrevrange(self.key, count=1)
        if last and last[0][1].get("type") == "run_done":
            return True
        # the ledger's word; the stream must also hold an entry per shard (mark_shard_done sets the
        # state before it appends the event)
        states = self.ledger.shard_states(self.run_id)
        return self.ledger.all_shards_done(self.run_id) and self.r.xlen(self.key) >= len(states)

    def _others_pending(self) -> int:
        total = int(self.r.xpending(self.key, self.group)["pending"])
        with self._lock:
            return total - len(self.held)

    def group_pending(self) -> int:
        return int(self.r.xpending(self.key, self.group)["pending"])

    # --- acks and keepalive -------------------------------------------------------------------------
    def ack(self, keys: set[tuple[str, int]]) -> int:
        """Ack every held entry whose shard is in `keys` (shards a written checkpoint lists)."""
        with self._lock:
            ids = [eid for eid, ref in self.held.items() if ref.key in keys]
            for eid in ids:
                del self.held[eid]
        return int(self.r.xack(self.key, self.group, *ids)) if ids else 0

    def still_ours(self, ref: ShardRef) -> bool:
        """Checked before a shard is recorded as consumed: one taken over must not count here."""
        if ref.entry_id in self.lost:
            return False
        return bool(self._keepalive(keys=[self.key], args=[self.group, self.consumer, ref.entry_id]))

    def _keepalive_loop(self) -> None:
        interval = max(0.2, self.claim_idle_ms / 4000)
        while not self._stop.wait(interval):
            with self._lock:
                ids = list(self.held)
            if not ids:
                continue
            try:
                kept = set(self._keepalive(keys=[self.key], args=[self.group, self.consumer, *ids]))
            except redis.RedisError as e:
                log.warning("keepalive of pending shards failed: %s", e)
                continue
            with self._lock:
                lost = [i for i in ids if i not in kept and i in self.held]
                for i in lost:
                    del self.held[i]
                self.lost.update(lost)
            if lost:
                log.warning("pending shard entries %s were taken over by another consumer", lost)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
