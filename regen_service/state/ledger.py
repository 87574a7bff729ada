"""The run ledger in Redis: run and shard records, progress counters, leases and the shard_done stream.

Redis is a fast shared cache of what storage holds: everything here can be rebuilt from the data root
by `regen resume` (regen_service.state.resume). Counters are SET per shard (never incremented per prompt),
so a shard that runs twice after a crash cannot double-count. Leases make one worker at a time own a
shard. Keys, all under the settings' key prefix P:

    P:runs                          set of run ids
    P:run:<rid>                     hash: run record (mix name, model, num_shards, num_prompts, state, ...)
    P:run:<rid>:shards              hash: shard id -> queued | running | done | failed
    P:run:<rid>:why                 hash: shard id -> why it failed (one line; gone once it leaves failed)
    P:run:<rid>:progress            hash: shard id -> prompts finished (answered or terminal error)
    P:run:<rid>:failed              hash: shard id -> prompts that ended with an error
    P:run:<rid>:tokens              hash: shard id -> completion tokens generated
    P:run:<rid>:srcdone             hash: "<shard>|<source>" -> prompts finished from that source
    P:run:<rid>:srcfailed           hash: "<shard>|<source>" -> prompts failed from that source
    P:run:<rid>:srctokens           hash: "<shard>|<source>" -> completion tokens from that source
    P:run:<rid>:rate                hash: "<unix second>[|<source>]" -> tokens finished then (last ~5 min)
    P:run:<rid>:events              stream of {type: shard_done|run_done, ...}     } read and written in
    P:run:<rid>:announced           set: shards (and "run") already on the stream  } state/events.py
    P:sweep:lock, P:sweep:seen      the dead-holder sweep's (state/reclaim.py)
    P:lease:<rid>:<shard>           string: owner token, TTL renewed by its holder (state/leases.py)
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import redis

from regen_service.settings import Settings
from regen_service.state import events
from regen_service.state.leases import LeaseKeys
from regen_service.state.leases import owner_node as owner_node  # re-exported: callers import them here
from regen_service.state.leases import owner_token as owner_token
from regen_service.state.redis_client import check_reachable as check_reachable
from regen_service.state.redis_client import connect, write_refusal
from schemas.records import RunManifest, ShardDoneEvent

SHARD_STATES = ("queued", "running", "done", "failed")
RATE_WINDOW_S = 300


@dataclass(frozen=True)
class RunCounters:
    """A run's per-shard counters added up, for status: states by shard, totals, totals by source."""

    shard_states: dict[int, str]
    prompts_done: int
    prompts_failed: int
    tokens: int
    done_by_source: dict[str, int]
    failed_by_source: dict[str, int]
    tokens_by_source: dict[str, int]


class Ledger(LeaseKeys):
    def __init__(self, settings: Settings, client: redis.Redis | None = None):
        self.settings = settings
        self.r = client or connect(settings)
        self.p = settings.key_prefix
        self._init_leases()

    # --- keys ---------------------------------------------------------------------------------------
    def run_key(self, run_id: str, suffix: str = "") -> str:
        return f"{self.p}:run:{run_id}" + (f":{suffix}" if suffix else "")

    def events_key(self, run_id: str) -> str:
        return events.events_key(self.p, run_id)

    def event_stream(self, run_id: str, group: str) -> events.EventStream:
        """A consumer group on the run's events (a trainer's view of them)."""
        return events.EventStream(self.r, self.p, run_id, group)

    def write_refusal(self) -> str | None:
        """Why this Redis would refuse writes now (maxmemory under noeviction, an AOF it cannot write)."""
        return write_refusal(self.r)

    # --- runs ---------------------------------------------------------------------------------------
    def register_run(self, manifest: RunManifest, data_root: str, done_shards: Iterable[int] = ()) -> bool:
        """Record a run and its shards. Returns False (and changes nothing) when the run is already known."""
        key = self.run_key(manifest.run_id)
        record = {
            "run_id": manifest.run_id,
            "mix_name": manifest.mix_name,
            "model": manifest.model,
            "api": manifest.api,
            "num_shards": manifest.num_shards,
            "num_prompts": manifest.num_prompts,
            "created_at": manifest.created_at,
            "registered_at": time.time(),
            "data_root": data_root,
            "shard_sources": json.dumps({s.shard_id: s.sources for s in manifest.shards}),
            "shard_sizes": json.dumps({s.shard_id: s.num_prompts for s in manifest.shards}),
            "source_stats": json.dumps({k: v.model_dump() for k, v in manifest.sources.items()}),
        }
        if not self.r.hsetnx(key, "run_id", manifest.run_id):
            return False
        done = set(done_shards)
        pipe = self.r.pipeline()
        pipe.hset(key, mapping=record)
        pipe.sadd(f"{self.p}:runs", manifest.run_id)
        states = {str(s.shard_id): ("done" if s.shard_id in done else "queued") for s in manifest.shards}
        if states:
            pipe.hset(self.run_key(manifest.run_id, "shards"), mapping=states)
        pipe.execute()
        return True

    def run_ids(self) -> list[str]:
        return sorted(self.r.smembers(f"{self.p}:runs"))

    def run_record(self, run_id: str) -> dict | None:
        rec = self.r.hgetall(self.run_key(run_id))
        return rec or None

    def shard_states(self, run_id: str) -> dict[int, str]:
        return {int(k): v for k, v in self.r.hgetall(self.run_key(run_id, "shards")).items()}

    def set_shard_state(self, run_id: str, shard_id: int, state: str) -> None:
        assert state in SHARD_STATES and state != "failed", state  # failed: set_shard_failed, with why
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(self.run_key(run_id, "shards"), str(shard_id), state)
        pipe.hdel(self.run_key(run_id, "why"), str(shard_id))
        if state != "done":  # to be done again (retry-failed, a lost output): announced again when it is
            pipe.srem(events.announced_key(self.p, run_id), str(shard_id))
        pipe.execute()

    def set_shard_failed(self, run_id: str, shard_id: int, why: str) -> None:
        """The shard ended without an output file; `why` (one line) is what status shows for it."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(self.run_key(run_id, "shards"), str(shard_id), "failed")
        pipe.hset(self.run_key(run_id, "why"), str(shard_id), why)
        pipe.execute()

    def shard_failures(self, run_id: str) -> dict[int, str]:
        """Why each failed shard failed (shards that failed before reasons were kept have none)."""
        return {int(k): v for k, v in self.r.hgetall(self.run_key(run_id, "why")).items()}

    def drop_shards(self, run_id: str, shard_ids: Iterable[int]) -> None:
        """Forget shards that are not the run's (a task that named a shard outside the manifest left
        them): their states, reasons and counters."""
        ids = {str(s) for s in shard_ids}
        for suffix in ("shards", "why", "progress", "failed", "tokens", "srcdone", "srcfailed", "srctokens"):
            key = self.run_key(run_id, suffix)
            fields = [f for f in self.r.hkeys(key) if f.split("|", 1)[0] in ids] if ids else []
            if fields:
                self.r.hdel(key, *fields)

    # --- progress -----------------------------------------------------------------------------------
    def set_progress(
        self,
        run_id: str,
        shard_id: int,
        *,
        num_finished: int,
        num_failed: int,
        num_tokens: int,
        per_source_finished: dict[str, int],
        per_source_failed: dict[str, int],
        per_source_tokens: dict[str, int] | None = None,
    ) -> None:
        """Record how much of a shard is durable. Idempotent: values are set, not added."""
        sid = str(shard_id)
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(self.run_key(run_id, "progress"), sid, num_finished)
        pipe.hset(self.run_key(run_id, "failed"), sid, num_failed)
        pipe.hset(self.run_key(run_id, "tokens"), sid, num_tokens)
        per_source = (
            ("srcdone", per_source_finished),
            ("srcfailed", per_source_failed),
            ("srctokens", per_source_tokens),
        )
        for suffix, values in per_source:
            if values:
                pipe.hset(self.run_key(run_id, suffix), mapping={f"{sid}|{k}": v for k, v in values.items()})
        pipe.execute()

    def run_counters(self, run_id: str) -> RunCounters:
        """Every progress counter of a run, summed over its shards, read in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        for suffix in ("shards", "progress", "failed", "tokens", "srcdone", "srcfailed", "srctokens"):
            pipe.hgetall(self.run_key(run_id, suffix))
        shards, progress, failed, tokens, srcdone, srcfailed, srctokens = pipe.execute()
        return RunCounters(
            shard_states={int(k): v for k, v in shards.items()},
            prompts_done=sum(int(v) for v in progress.values()),
            prompts_failed=sum(int(v) for v in failed.values()),
            tokens=sum(int(v) for v in tokens.values()),
            done_by_source=_sum_by_source(srcdone),
            failed_by_source=_sum_by_source(srcfailed),
            tokens_by_source=_sum_by_source(srctokens),
        )

    def add_rate_tokens(self, run_id: str, per_source: dict[str, int], now: float | None = None) -> None:
        """Feed the tokens/s figures (fields "<second>" and "<second>|<source>"); a rate, not a total, so
        a redo after a crash only blips it."""
        per_source = {k: v for k, v in per_source.items() if v > 0}
        if not per_source:
            return
        sec = str(int(now or time.time()))
        key = self.run_key(run_id, "rate")
        pipe = self.r.pipeline(transaction=False)
        pipe.hincrby(key, sec, sum(per_source.values()))
        for src, n in per_source.items():
            pipe.hincrby(key, f"{sec}|{src}", n)
        pipe.expire(key, RATE_WINDOW_S * 2)
        pipe.execute()

    def tokens_last_window(
        self, run_id: str, window_s: int = 60, now: float | None = None
    ) -> tuple[int, dict[str, int]]:
        """Tokens finished in the last window_s seconds: the run's total and per source."""
        now_s = int(now or time.time())
        data = self.r.hgetall(self.run_key(run_id, "rate"))
        total, by_source, stale = 0, defaultdict(int), []
        for field, value in data.items():
            sec, _, src = field.partition("|")
            if int(sec) < now_s - RATE_WINDOW_S:
                stale.append(field)
            elif now_s - window_s < int(sec) <= now_s:
                if src:
                    by_source[src] += int(value)
                else:
                    total += int(value)
        if stale:
            self.r.hdel(self.run_key(run_id, "rate"), *stale)
        return total, dict(by_source)

    # --- shard completion ---------------------------------------------------------------------------
    def mark_shard_done(self, event: ShardDoneEvent) -> bool:
        """Mark the shard done and append its shard_done event (run_done after the last), once per
        ledger: False when it was on the stream already. Readers parse it back with read_shard_done."""
        fields = {"type": "shard_done", **_flat(event.model_dump())}
        return events.announce(self.r, self.p, event.run_id, event.shard_id, fields)

    def all_shards_done(self, run_id: str) -> bool:
        states = self.shard_states(run_id)
        return bool(states) and all(s == "done" for s in states.values())

    # --- leases -------------------------------------------------------------------------------------


def read_shard_done(fields: Mapping[str, str]) -> ShardDoneEvent | None:
    """A stream entry as mark_shard_done wrote it, back as its event; None for an entry of another type.
    Raises pydantic.ValidationError for a shard_done entry its schema refuses."""
    if fields.get("type") != "shard_done":
        return None
    # _flat stored every non-string as JSON text: the schema's lax mode reads the numbers back.
    return ShardDoneEvent.model_validate({k: v for k, v in fields.items() if k != "type"})


def _sum_by_source(hash_: dict[str, str]) -> dict[str, int]:
    """Fields "<shard>|<source>" summed per source."""
    out: dict[str, int] = defaultdict(int)
    for k, v in hash_.items():
        out[k.split("|", 1)[1]] += int(v)
    return dict(out)


def _flat(d: dict) -> dict[str, str]:
    return {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in d.items()}
