"""The run's shard_done stream, read through a Redis consumer group so no shard is trained twice.

Exactly-once across kills and several trainers rests on four rules:
- an entry is XACKed only after a checkpoint that lists its shard as consumed was written;
- a (re)started trainer first takes its own pending entries (same consumer name: by default derived
  from the output directory), acks those its checkpoint already lists and re-trains the others;
- entries another consumer left pending longer than `claim_idle_s` are taken over (XAUTOCLAIM);
- while training, a keepalive thread re-claims our own pending entries (only those still ours,
  checked in one Lua call), so a live but slow trainer's shard is never taken over.
Redis may be lost under a trainer (wiped, restarted empty): the stream's group is made again
(state/events.py), entries held from before count as ours, and the trainer never ends while a shard
finished in storage was never on the stream (it waits, saying why, for `regen resume`; without
--follow it ends listing them, not "done"). Every Redis call is state/events.py's.
New entries are read one at a time, when the trainer is ready for them, so trainers sharing a
group split the run fairly. The training itself, and which shards count as consumed, is train.py's.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from dataclasses import dataclass

import pydantic
import redis

from regen_service.state.ledger import Ledger, read_shard_done
from regen_service.state.runinfo import done_shards_in_storage
from regen_service.state.storage import RunLayout, Storage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardRef:
    entry_id: str
    run_id: str
    shard_id: int
    path: str
    num_rows: int
    generation: int = 0  # the stream's generation it came from (a Redis wipe starts a new one)

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
        storage: Storage | None = None,
    ):
        self.ledger, self.run_id = ledger, run_id
        self.stream = ledger.event_stream(run_id, group)
        self.consumer = consumer
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self.poll_s = poll_s
        # Storage is the truth: the run's finished shards are its output files, whatever Redis lost.
        self.layout = RunLayout(storage, run_id) if storage is not None else None
        self.queue: list[ShardRef] = []
        self.held: dict[str, ShardRef] = {}  # delivered to us, not acked
        self._lock = threading.Lock()
        self._started_pending = False
        self.lost: set[str] = set()  # entries taken over by another consumer while we held them
        self.unannounced: list[int] = []  # finished in storage, never on the stream (set at the end)
        self._said_at = 0.0
        self._stop = threading.Event()
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
        self.stream.ack(other)
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
        return ShardRef(
            entry_id, event.run_id, event.shard_id, event.path, event.num_rows, self.stream.generation
        )

    def _own_pending(self) -> list[ShardRef]:
        out, last = [], "0"
        while entries := self.stream.read_pending(self.consumer, last):
            last = entries[-1][0]
            out += self._take(entries)
        return out

    def _claim_stale(self) -> list[ShardRef]:
        out, start = [], "0-0"
        while True:
            start, entries = self.stream.claim_stale(self.consumer, self.claim_idle_ms, start)
            out += self._take(entries)
            if start in ("0-0", b"0-0"):
                return out

    def _refill(self, block_ms: int | None) -> None:
        if not self._started_pending:
            self.queue += self._own_pending()
            self._started_pending = True
        if not self.queue:
            self.queue += self._claim_stale()
        if not self.queue:
            self.queue += self._take(self.stream.read_new(self.consumer, block_ms))

    def next(self, follow: bool) -> ShardRef | None:
        """The next shard to train, or None once there is none (now; with follow: ever)."""
        while True:
            finished = follow and self.run_finished()  # observed BEFORE the read below
            self._refill(None)
            if self.queue:
                return self.queue.pop(0)
            if not follow or (finished and self._others_pending() == 0):
                # Before "no more": every shard finished in storage must have been on the stream. One
                # that is not was lost with the ledger; ending now would leave it untrained in silence.
                self.unannounced = self._unannounced()
                if not self.unannounced or not follow:
                    return None
            self._say_why_waiting()
            self._refill(int(self.poll_s * 1000))
            if self.queue:
                return self.queue.pop(0)

    # --- run state ----------------------------------------------------------------------------------
    def run_finished(self) -> bool:
        if self.stream.last_type() == "run_done":
            return True
        # the ledger's word; the stream must also hold an entry per shard (announced with the done mark)
        states = self.ledger.shard_states(self.run_id)
        return self.ledger.all_shards_done(self.run_id) and self.stream.num_announced() >= len(states)

    def _unannounced(self) -> list[int]:
        if self.layout is None:
            return []
        return sorted(done_shards_in_storage(self.layout) - self.stream.announced_shards())

    def _say_why_waiting(self, every_s: float = 60.0) -> None:
        """--follow waits as long as the run is not done: say why, once a minute, never in silence."""
        now = time.monotonic()
        if now - self._said_at < every_s:
            return
        first = not self._said_at
        self._said_at = now
        if self.ledger.run_record(self.run_id) is None:
            log.warning("run %s is not in the ledger (Redis wiped or restarted empty?): waiting for "
                        "`regen resume %s` to rebuild it from storage", self.run_id, self.run_id)  # fmt: skip
        elif self.unannounced:
            log.warning("shards %s of run %s are finished in storage but not on its event stream: waiting for "
                        "`regen resume %s` to announce them", self.unannounced, self.run_id, self.run_id)  # fmt: skip
        elif not first:
            states = list(self.ledger.shard_states(self.run_id).values())
            log.info("waiting for run %s: %d of %d shards done, %d announced", self.run_id,
                     states.count("done"), len(states), self.stream.num_announced())  # fmt: skip

    def _others_pending(self) -> int:
        total = self.stream.pending()
        with self._lock:
            return total - sum(1 for r in self.held.values() if r.generation == self.stream.generation)

    def group_pending(self) -> int:
        return self.stream.pending()

    # --- acks and keepalive -------------------------------------------------------------------------
    def ack(self, keys: set[tuple[str, int]]) -> int:
        """Ack every held entry whose shard is in `keys` (shards a written checkpoint lists)."""
        with self._lock:
            refs = [ref for ref in self.held.values() if ref.key in keys]
            for ref in refs:
                del self.held[ref.entry_id]
        # Entries of a stream Redis lost are gone with it: nothing left to ack.
        return self.stream.ack([r.entry_id for r in refs if r.generation == self.stream.generation])

    def still_ours(self, ref: ShardRef) -> bool:
        """Checked before a shard is recorded as consumed: one taken over must not count here. One
        delivered before Redis lost the stream was ours alone: nobody can have taken it since."""
        if ref.entry_id in self.lost:
            return False
        if ref.generation != self.stream.generation:
            return True
        return bool(self.stream.keepalive(self.consumer, [ref.entry_id]))

    def _keepalive_loop(self) -> None:
        interval = max(0.2, self.claim_idle_ms / 4000)
        while not self._stop.wait(interval):
            with self._lock:
                gen = self.stream.generation
                ids = [eid for eid, ref in self.held.items() if ref.generation == gen]
            if not ids:
                continue
            try:
                kept = set(self.stream.keepalive(self.consumer, ids))
            except redis.RedisError as e:
                log.warning("keepalive of pending shards failed: %s", e)
                continue
            if self.stream.generation != gen:
                continue  # the stream was lost under us: those ids are no one's now
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
