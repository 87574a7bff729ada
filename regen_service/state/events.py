"""A run's events stream (shard_done, run_done) and its consumer groups: every Redis call on them.

The ledger (state/ledger.py) owns the keys and appends through `announce`; trainers read through an
EventStream (train/consumer.py decides what to read when and what to ack). Keys, under prefix P:

    P:run:<rid>:events              stream of {type: shard_done|run_done, ...}
    P:run:<rid>:announced           set of shard ids (and "run") already on the stream

A shard is announced once per ledger (until it is set to be done again): the `announced` set is the gate, so `regen resume` after a
Redis wipe (stream, groups and set all gone) announces every finished shard again, from storage,
and a shard finished twice (a redelivered duplicate, retry-failed) is on the stream once. run_done
follows the last shard's entry. A consumer group that vanished with a wipe (Redis answers NOGROUP,
its error code for "no such group") is created again, empty, by the next read: the EventStream
counts those as `generation`, so the trainer knows entries it held before are gone.
"""

from __future__ import annotations

import logging

import redis

log = logging.getLogger(__name__)

# KEYS: shards hash, announced set, stream. ARGV: shard id, run id, then the entry's field/value pairs.
# Returns 1 when the shard's entry was appended now, 0 when it was on the stream already.
_ANNOUNCE = """
redis.call('hset', KEYS[1], ARGV[1], 'done')
if redis.call('sadd', KEYS[2], ARGV[1]) == 0 then return 0 end
local fields = {}
for i = 3, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('xadd', KEYS[3], '*', unpack(fields))
local states = redis.call('hvals', KEYS[1])
for _, s in ipairs(states) do if s ~= 'done' then return 1 end end
if redis.call('scard', KEYS[2]) >= #states and redis.call('sadd', KEYS[2], 'run') == 1 then
  redis.call('xadd', KEYS[3], '*', 'type', 'run_done', 'run_id', ARGV[2])
end
return 1
"""

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


def events_key(prefix: str, run_id: str) -> str:
    return f"{prefix}:run:{run_id}:events"


def announced_key(prefix: str, run_id: str) -> str:
    return f"{prefix}:run:{run_id}:announced"


def announce(r: redis.Redis, prefix: str, run_id: str, shard_id: int, fields: dict[str, str]) -> bool:
    """Mark the shard done and put its shard_done entry on the stream, once per ledger (see above)."""
    args = [str(shard_id), run_id] + [x for kv in fields.items() for x in kv]
    keys = [f"{prefix}:run:{run_id}:shards", announced_key(prefix, run_id), events_key(prefix, run_id)]
    return bool(r.register_script(_ANNOUNCE)(keys=keys, args=args))


def _no_group(e: redis.ResponseError) -> bool:
    # Redis error replies start with their error code; NOGROUP is the code for a missing group or stream.
    return str(e).split(" ", 1)[0] == "NOGROUP"


class EventStream:
    """One consumer group on one run's stream, recreated when Redis lost it."""

    def __init__(self, r: redis.Redis, prefix: str, run_id: str, group: str) -> None:
        self.r, self.run_id, self.group = r, run_id, group
        self.key = events_key(prefix, run_id)
        self.announced = announced_key(prefix, run_id)
        self.generation = 0  # how many times the group was found gone and made again
        self._keepalive = r.register_script(_KEEPALIVE)
        self._create()

    def _create(self) -> None:
        try:
            self.r.xgroup_create(self.key, self.group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if str(e).split(" ", 1)[0] != "BUSYGROUP":  # BUSYGROUP: it exists already, as wanted
                raise

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except redis.ResponseError as e:
            if not _no_group(e):
                raise
        self.generation += 1
        log.warning(
            "the ledger lost run %s's event stream (Redis wiped, or restarted without its data); waiting "
            "for `regen resume %s` to announce its finished shards again from storage",
            self.run_id,
            self.run_id,
        )
        self._create()
        return fn(*args, **kwargs)

    # --- reading ------------------------------------------------------------------------------------
    def read_pending(self, consumer: str, after: str, count: int = 100) -> list:
        """Entries delivered to `consumer` and not acked, after id `after`."""
        resp = self._call(self.r.xreadgroup, self.group, consumer, {self.key: after}, count=count)
        return resp[0][1] if resp else []

    def read_new(self, consumer: str, block_ms: int | None) -> list:
        resp = self._call(self.r.xreadgroup, self.group, consumer, {self.key: ">"}, count=1, block=block_ms)
        return resp[0][1] if resp else []

    def claim_stale(self, consumer: str, idle_ms: int, start: str, count: int = 50) -> tuple[str, list]:
        """XAUTOCLAIM: entries others left pending longer than idle_ms; returns (next start, entries)."""
        resp = self._call(
            self.r.xautoclaim, self.key, self.group, consumer, idle_ms, start_id=start, count=count
        )
        return resp[0], [e for e in resp[1] if e is not None]

    # --- acks and claims ----------------------------------------------------------------------------
    def ack(self, ids: list[str]) -> int:
        return int(self._call(self.r.xack, self.key, self.group, *ids)) if ids else 0

    def keepalive(self, consumer: str, ids: list[str]) -> list[str]:
        """Re-claim each of `ids` still pending for `consumer`; returns those (the others were taken)."""
        return list(self._call(self._keepalive, keys=[self.key], args=[self.group, consumer, *ids]))

    def pending(self) -> int:
        return int(self._call(self.r.xpending, self.key, self.group)["pending"])

    # --- the run's state on the stream --------------------------------------------------------------
    def last_type(self) -> str | None:
        last = self.r.xrevrange(self.key, count=1)
        return last[0][1].get("type") if last else None

    def num_announced(self) -> int:
        """Entries on the stream (as before the announced set: what run_finished compares to the shards)."""
        return int(self.r.xlen(self.key))

    def announced_shards(self) -> set[int]:
        """Shard ids the stream's shard_done entries name, whoever wrote them (read at a trainer's end)."""
        found: set[int] = set()
        for _, fields in self.r.xrange(self.key):
            sid = fields.get("shard_id", "")
            if fields.get("type") == "shard_done" and fields.get("run_id") == self.run_id and sid.isdigit():
                found.add(int(sid))
        return found
