"""What is durable of one shard, counted, and written to the ledger: the shard runner's counters as it
answers rows, and resume's when it rebuilds them from storage.

A Progress is the rows of a shard made durable so far (from its shard log or its output file), with
the per-source counts the ledger shows. Setting them in the ledger, and marking a shard done once with
its shard_done event, happen here, so the worker and `regen resume` count the same way. Taking leases,
asking endpoints and writing shard files are regen_service.work.shard_runner's; the Redis keys are the
ledger's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from regen_service.state.ledger import Ledger
from regen_service.state.storage import RunLayout
from schemas.records import ShardDoneEvent
from schemas.rows import OutputRow, output_rows


@dataclass
class Progress:
    """What is durable of one shard: its rows by prompt id, and the counts the ledger shows per source."""

    rows: dict[str, OutputRow]
    by_source: Counter = field(default_factory=Counter)
    failed_by_source: Counter = field(default_factory=Counter)
    tokens_by_source: Counter = field(default_factory=Counter)
    unreported_by_source: Counter = field(default_factory=Counter)

    @property
    def tokens(self) -> int:
        return sum(self.tokens_by_source.values())

    def add(self, row: OutputRow, *, new: bool) -> None:
        self.rows[row.prompt_id] = row
        self.by_source[row.source] += 1
        if row.error:
            self.failed_by_source[row.source] += 1
        tok = row.completion_tokens or 0
        self.tokens_by_source[row.source] += tok
        if new:
            self.unreported_by_source[row.source] += tok


@dataclass(frozen=True)
class ProgressReport:
    """A copy of a Progress's counters, taken where the Progress is mutated (the event loop), so the
    thread that writes it to the ledger never reads dicts the loop is changing."""

    num_finished: int
    num_failed: int
    num_tokens: int
    per_source_finished: dict
    per_source_failed: dict
    per_source_tokens: dict
    new_tokens_by_source: dict


def take_report(prog: Progress) -> ProgressReport:
    report = ProgressReport(
        num_finished=len(prog.rows),
        num_failed=sum(prog.failed_by_source.values()),
        num_tokens=prog.tokens,
        per_source_finished=dict(prog.by_source),
        per_source_failed=dict(prog.failed_by_source),
        per_source_tokens=dict(prog.tokens_by_source),
        new_tokens_by_source=dict(prog.unreported_by_source),
    )
    prog.unreported_by_source.clear()
    return report


def write_report(ledger: Ledger, run_id: str, shard_id: int, report: ProgressReport) -> None:
    ledger.set_progress(
        run_id,
        shard_id,
        num_finished=report.num_finished,
        num_failed=report.num_failed,
        num_tokens=report.num_tokens,
        per_source_finished=report.per_source_finished,
        per_source_failed=report.per_source_failed,
        per_source_tokens=report.per_source_tokens,
    )
    ledger.add_rate_tokens(run_id, report.new_tokens_by_source)


def record_progress(ledger: Ledger, run_id: str, shard_id: int, prog: Progress) -> None:
    """For the thread that owns `prog` (no event loop is changing it)."""
    write_report(ledger, run_id, shard_id, take_report(prog))


def mark_done_from_file(ledger: Ledger, layout: RunLayout, shard_id: int) -> ShardDoneEvent:
    """The output file exists (it is the completion marker): make the ledger agree, idempotently."""
    table = layout.storage.read_table(layout.output_shard(shard_id))
    rows = output_rows(table.select(["prompt_id", "source", "error", "completion_tokens"]))
    prog = Progress(rows={})
    for r in rows:
        prog.add(r, new=False)
    return announce_done(ledger, layout, shard_id, prog)


def announce_done(ledger: Ledger, layout: RunLayout, shard_id: int, prog: Progress) -> ShardDoneEvent:
    """Final counters, then the done mark and its shard_done event (once, whoever calls it)."""
    record_progress(ledger, layout.run_id, shard_id, prog)
    event = ShardDoneEvent(
        run_id=layout.run_id,
        shard_id=shard_id,
        path=layout.output_shard(shard_id),
        num_rows=len(prog.rows),
        num_errors=sum(prog.failed_by_source.values()),
        num_tokens=prog.tokens,
    )
    ledger.mark_shard_done(event)
    return event
