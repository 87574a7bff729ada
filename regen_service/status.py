"""Progress of runs, from the ledger alone: a handful of hash reads per run, cheap at 83K prompts.

Counters are per shard (set by the shard's holder), so status sums at most a few thousand fields and
never reads storage. Rendering for humans (rich) and machines (--json) lives at the bottom.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict

from regen_service.ledger import Ledger

JSON_KEYS = (
    "run_id", "state", "shards_total", "shards_done", "shards_failed", "prompts_total", "prompts_done",
    "prompts_failed", "tokens_generated", "tokens_per_s", "eta_s", "sources",
)  # fmt: skip


def _sum_by_source(hash_: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for k, v in hash_.items():
        out[k.split("|", 1)[1]] += int(v)
    return out


def run_status(ledger: Ledger, run_id: str, now: float | None = None) -> dict | None:
    rec = ledger.run_record(run_id)
    if rec is None:
        return None
    r = ledger.r
    pipe = r.pipeline(transaction=False)
    for suffix in ("shards", "progress", "failed", "tokens", "srcdone", "srcfailed"):
        pipe.hgetall(ledger.run_key(run_id, suffix))
    shards, progress, failed, tokens, srcdone, srcfailed = pipe.execute()
    shard_sources: dict[str, dict[str, int]] = json.loads(rec.get("shard_sources", "{}"))
    states = list(shards.values())
    prompts_total = int(rec.get("num_prompts", 0))
    prompts_done = sum(int(v) for v in progress.values())
    prompts_failed = sum(int(v) for v in failed.values())
    tokens_generated = sum(int(v) for v in tokens.values())
    tokens_per_s = ledger.tokens_last_window(run_id, 60, now) / 60.0
    shards_done = states.count("done")
    shards_failed = states.count("failed")
    remaining = max(0, prompts_total - prompts_done)
    eta_s = None
    if remaining == 0:
        eta_s = 0.0
    elif tokens_per_s > 0 and prompts_done > 0:
        eta_s = round(remaining * (tokens_generated / prompts_done) / tokens_per_s, 1)
    if shards_done == len(states) and states:
        state = "done"
    elif shards_failed and not any(s in ("queued", "running") for s in states):
        state = "failed"
    elif "running" in states or prompts_done > 0 or shards_done > 0:
        state = "running"
    else:
        state = "queued"

    done_by_src, failed_by_src = _sum_by_source(srcdone), _sum_by_source(srcfailed)
    sources: dict[str, dict] = {}
    for sid, per_src in shard_sources.items():
        st = shards.get(str(sid), "queued")
        for name, n in per_src.items():
            s = sources.setdefault(
                name, {"shards_total": 0, "shards_done": 0, "shards_failed": 0, "prompts_total": 0}
            )
            s["shards_total"] += 1
            s["shards_done"] += st == "done"
            s["shards_failed"] += st == "failed"
            s["prompts_total"] += n
    for name, s in sources.items():
        s["prompts_done"] = done_by_src.get(name, 0)
        s["prompts_failed"] = failed_by_src.get(name, 0)
    return {
        "run_id": run_id,
        "state": state,
        "shards_total": len(states),
        "shards_done": shards_done,
        "shards_failed": shards_failed,
        "prompts_total": prompts_total,
        "prompts_done": prompts_done,
        "prompts_failed": prompts_failed,
        "tokens_generated": tokens_generated,
        "tokens_per_s": round(tokens_per_s, 1),
        "eta_s": eta_s,
        "sources": sources,
        "mix_name": rec.get("mix_name"),
        "model": rec.get("model"),
        "updated_at": now or time.time(),
    }


def render(statuses: list[dict]) -> None:
    """A rich view: one progress bar per run and per source."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn

    console = Console()
    if not statuses:
        console.print("no runs in the ledger (enqueue one with `regen enqueue MIX.yaml`)")
        return
    for st in statuses:
        eta = "-" if st["eta_s"] is None else f"{st['eta_s']:.0f}s"
        console.print(
            f"[bold]{st['run_id']}[/bold]  {st['state']}  shards {st['shards_done']}/{st['shards_total']}"
            f" (failed {st['shards_failed']})  prompts {st['prompts_done']}/{st['prompts_total']}"
            f" (failed {st['prompts_failed']})  tokens {st['tokens_generated']}  {st['tokens_per_s']} tok/s  ETA {eta}"
        )
        progress = Progress(
            TextColumn("  {task.description:<24}"), BarColumn(), TextColumn("{task.completed}/{task.total} prompts"),
            TextColumn("{task.fields[extra]}"), console=console, auto_refresh=False,
        )  # fmt: skip
        for name, s in sorted(st["sources"].items()):
            progress.add_task(
                name, total=max(1, s["prompts_total"]), completed=s["prompts_done"],
                extra=f"failed {s['prompts_failed']}, shards {s['shards_done']}/{s['shards_total']}",
            )  # fmt: skip
        progress.refresh()
        console.print(progress)
