"""Progress of runs, from the ledger alone: a handful of hash reads per run, cheap at 83K prompts.

Counters are per shard (set by the shard's holder), so status sums at most a few thousand fields and
never reads storage. The live workers (regen_service.state.presence) come along, so a run nobody consumes
says so. Rendering for humans is regen_service.cli.status_view's.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict

from regen_service.state.ledger import Ledger
from regen_service.state.presence import live_workers
from regen_service.state.reclaim import dead_holder_shards

JSON_KEYS = (
    "run_id", "state", "shards_total", "shards_done", "shards_failed", "prompts_total", "prompts_done",
    "prompts_failed", "tokens_generated", "tokens_per_s", "eta_s", "sources", "live_consumers", "workers",
    "done_with_failures", "failed_shards", "next_step", "dead_holder_shards", "redis_refuses_writes",
)  # fmt: skip
MAX_FAILED_SHARDS_SHOWN = 20


def _eta_s(remaining: int, done: int, tokens: int, tokens_per_s: float) -> float | None:
    """Seconds left at the last minute's rate, from the tokens a finished prompt took on average."""
    if remaining <= 0:
        return 0.0
    if tokens_per_s <= 0 or done <= 0:
        return None
    return round(remaining * (tokens / done) / tokens_per_s, 1)


def _state(states: list[str], done_prompts: int) -> str:
    if states and all(s == "done" for s in states):
        return "done"
    if "failed" in states and not any(s in ("queued", "running") for s in states):
        return "failed"
    if "running" in states or done_prompts > 0 or "done" in states:
        return "running"
    return "queued"


def run_status(ledger: Ledger, run_id: str, now: float | None = None) -> dict | None:
    rec = ledger.run_record(run_id)
    if rec is None:
        return None
    counters = ledger.run_counters(run_id)
    shard_sources: dict[str, dict[str, int]] = json.loads(rec.get("shard_sources", "{}"))
    states = list(counters.shard_states.values())
    window_tokens, window_by_source = ledger.tokens_last_window(run_id, 60, now)
    prompts_total = int(rec.get("num_prompts", 0))
    prompts_done = counters.prompts_done
    tokens_generated = counters.tokens
    tokens_per_s = window_tokens / 60.0

    per_src: dict[str, dict] = {}
    src_states: dict[str, list[str]] = defaultdict(list)
    for sid, counts in shard_sources.items():
        st = counters.shard_states.get(int(sid), "queued")
        for name, n in counts.items():
            s = per_src.setdefault(
                name, {"shards_total": 0, "shards_done": 0, "shards_failed": 0, "prompts_total": 0}
            )
            s["shards_total"] += 1
            s["shards_done"] += st == "done"
            s["shards_failed"] += st == "failed"
            s["prompts_total"] += n
            src_states[name].append(st)
    done_by, failed_by, tokens_by = (
        counters.done_by_source,
        counters.failed_by_source,
        counters.tokens_by_source,
    )
    # Sources that kept nothing have no shard: list them too, with what enqueue read and quarantined.
    for name, counts in json.loads(rec.get("source_stats", "{}")).items():
        s = per_src.setdefault(
            name, {"shards_total": 0, "shards_done": 0, "shards_failed": 0, "prompts_total": 0}
        )
        s.update(
            read=counts.get("read", 0), kept=counts.get("kept", 0), quarantined=counts.get("quarantined", 0)
        )
    for name, s in per_src.items():
        s["prompts_done"] = done_by.get(name, 0)
        s["prompts_failed"] = failed_by.get(name, 0)
        s["tokens_generated"] = tokens_by.get(name, 0)
        s["tokens_per_s"] = round(window_by_source.get(name, 0) / 60.0, 1)
        s["eta_s"] = _eta_s(s["prompts_total"] - s["prompts_done"], s["prompts_done"], s["tokens_generated"],
                            s["tokens_per_s"])  # fmt: skip
        s["state"] = _state(src_states[name], s["prompts_done"])
    workers = live_workers(ledger.settings, ledger.r)
    state = _state(states, prompts_done)
    # `done` stays the word for "finished, nothing more will happen" (scripts wait for it); a done run
    # whose rows hold errors says so beside it, with the command that asks those rows again.
    done_with_failures = state == "done" and counters.prompts_failed > 0
    why = ledger.shard_failures(run_id) if "failed" in states else {}
    failed_shards = {
        sid: why.get(sid, "(no reason recorded)")
        for sid, st in sorted(counters.shard_states.items())
        if st == "failed"
    }
    # Shards a dead worker held: its lease still runs, or it ran out and the sweep has yet to requeue.
    dead = dead_holder_shards(ledger, run_id, counters.shard_states, {w.get("node") for w in workers})
    next_step = None
    if done_with_failures:
        next_step = f"regen retry-failed {run_id}  (rows that exhausted their retries; --include-terminal: 4xx rows too)"
    elif state == "failed" or failed_shards:
        next_step = f"fix what failed_shards says, then `regen resume {run_id}` queues those shards again"
    return {
        "run_id": run_id,
        "live_consumers": sum(w.get("state") == "consuming" for w in workers),
        "workers": workers,
        "state": state,
        "done_with_failures": done_with_failures,
        "failed_shards": dict(list(failed_shards.items())[:MAX_FAILED_SHARDS_SHOWN]),
        "next_step": next_step,
        "dead_holder_shards": dict(list(dead.items())[:MAX_FAILED_SHARDS_SHOWN]),
        "redis_refuses_writes": ledger.write_refusal(),
        "shards_total": len(states),
        "shards_done": states.count("done"),
        "shards_failed": states.count("failed"),
        "prompts_total": prompts_total,
        "prompts_done": prompts_done,
        "prompts_failed": counters.prompts_failed,
        "tokens_generated": tokens_generated,
        "tokens_per_s": round(tokens_per_s, 1),
        "eta_s": _eta_s(prompts_total - prompts_done, prompts_done, tokens_generated, tokens_per_s),
        "sources": per_src,
        "mix_name": rec.get("mix_name"),
        "model": rec.get("model"),
        "updated_at": now or time.time(),
    }
