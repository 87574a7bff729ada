"""`regen status` for people: progress bars on a terminal, full-width plain lines in a pipe or file,
and `--watch` redrawn in place (rich Live) rather than appended. The numbers are regen_service.state.status's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn
from rich.text import Text


def _eta(st: dict) -> str:
    return "-" if st["eta_s"] is None else f"{st['eta_s']:.0f}s"


def _consumer_warning(st: dict) -> str | None:
    if st["state"] in ("done", "failed") or st.get("live_consumers", 1):
        return None
    stuck = [w for w in st.get("workers", []) if w.get("state") != "consuming"]
    why = "; ".join(
        f"{w.get('node')}: {w.get('state')} for {time.time() - float(w.get('since', time.time())):.0f}s "
        f"({w.get('reason', '')})"
        for w in stuck
    )
    return "no live consumer for this run: " + (why or "no worker is running (start `regen worker`)")


def _state_words(st: dict) -> str:
    if st.get("done_with_failures"):
        return f"done ({st['prompts_failed']} of {st['prompts_total']} prompts failed)"
    return st["state"]


def failure_lines(st: dict) -> list[str]:
    """Why shards failed, and what to run next: under the headline, in text and on a terminal."""
    lines = [f"  shard {sid:>5} failed: {why}" for sid, why in st.get("failed_shards", {}).items()]
    lines += [f"  shard {sid:>5} {why}" for sid, why in st.get("dead_holder_shards", {}).items()]
    if st.get("next_step"):
        lines.append(f"  next: {st['next_step']}")
    return lines


def run_headline(st: dict) -> str:
    return (
        f"{st['run_id']}  {st.get('mix_name') or ''}  {_state_words(st)}  shards {st['shards_done']}/"
        f"{st['shards_total']} (failed {st['shards_failed']})  prompts {st['prompts_done']}/{st['prompts_total']}"
        f" (failed {st['prompts_failed']})  tokens {st['tokens_generated']}  {st['tokens_per_s']} tok/s  "
        f"ETA {_eta(st)}"
    )


def source_line(name: str, s: dict) -> str:
    quarantine = f", quarantined {s['quarantined']}/{s['read']}" if "quarantined" in s else ""
    return (
        f"{s['prompts_done']}/{s['prompts_total']} prompts, failed {s['prompts_failed']}, shards "
        f"{s['shards_done']}/{s['shards_total']}, {s['tokens_per_s']} tok/s, {s['state']}{quarantine}"
    )


def plain_lines(statuses: list[dict], storage_only: list[str] = ()) -> list[str]:
    """Everything on whole lines, never cut: for pipes, files and logs."""
    lines = []
    for st in statuses:
        lines.append(run_headline(st))
        if warning := _consumer_warning(st):
            lines.append(f"  WARNING {warning}")
        if st.get("redis_refuses_writes"):
            lines.append(f"  WARNING {st['redis_refuses_writes']}")
        lines += failure_lines(st)
        for name, s in sorted(st["sources"].items()):
            lines.append(f"  {name}: {source_line(name, s)}")
    for rid in storage_only:
        lines.append(f"{rid}  not in the ledger (Redis lost it?): `regen resume {rid}` rebuilds it")
    if not lines:
        lines.append(
            "no runs in the ledger or under the data root (enqueue one with `regen enqueue MIX.yaml`)"
        )
    return lines


def rich_view(statuses: list[dict], storage_only: list[str] = ()) -> Group:
    """Bars per run and source, for a terminal."""
    parts = []
    for st in statuses:
        parts.append(Text(run_headline(st), style="bold"))
        if warning := _consumer_warning(st):
            parts.append(Text(f"  {warning}", style="bold red"))
        if st.get("redis_refuses_writes"):
            parts.append(Text(f"  {st['redis_refuses_writes']}", style="bold red"))
        parts += [Text(line, style="yellow") for line in failure_lines(st)]
        progress = Progress(
            TextColumn("  {task.description:<24}"), BarColumn(), TextColumn("{task.fields[extra]}"),
            auto_refresh=False,
        )  # fmt: skip
        for name, s in sorted(st["sources"].items()):
            progress.add_task(name, total=max(1, s["prompts_total"]), completed=s["prompts_done"],
                              extra=source_line(name, s))  # fmt: skip
        parts.append(progress)
    for line in plain_lines([], storage_only) if storage_only else []:
        parts.append(Text(line, style="yellow"))
    if not parts:
        parts.append(Text(plain_lines([])[0]))
    return Group(*parts)


def show(fetch: Callable[[], tuple[list[dict], list[str]]], watch_s: float | None) -> None:
    """Print once, or with watch_s redraw until every run is done or failed."""
    console = Console()
    statuses, storage_only = fetch()
    if not console.is_terminal:
        while True:
            for line in plain_lines(statuses, storage_only):
                print(line, flush=True)
            if not watch_s or all(s["state"] in ("done", "failed") for s in statuses):
                return
            time.sleep(watch_s)
            statuses, storage_only = fetch()
    if not watch_s:
        console.print(rich_view(statuses, storage_only))
        return
    with Live(rich_view(statuses, storage_only), console=console, auto_refresh=False) as live:
        while not all(s["state"] in ("done", "failed") for s in statuses):
            time.sleep(watch_s)
            statuses, storage_only = fetch()
            live.update(rich_view(statuses, storage_only), refresh=True)
