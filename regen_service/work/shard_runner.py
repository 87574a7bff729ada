"""Process one prompt shard into one output shard, exactly once, whatever crashes around it.

The steps: skip a shard whose output already exists; take the shard's lease (another live holder means
"not now": the caller retries later); load the rows earlier holders made durable and ask only for the
rest, in a ShardSession (shard_session.py: a heartbeat keeps the lease alive and losing it stops the work
before anything final is written; each answered row goes to the shard log as it finishes); write the
final shard atomically in prompt order; mark it done in the ledger, which appends the shard_done event
once. Talking to endpoints is the Regenerator's job; the queue plumbing is regen_service.work.worker_app's.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from regen_service.errors import EndpointTerminalError, LeaseLostError
from regen_service.state.ledger import Ledger, owner_token
from regen_service.state.progress import Progress, announce_done, mark_done_from_file, record_progress
from regen_service.state.reuse_map import reused_rows
from regen_service.state.runinfo import load_run_mix
from regen_service.state.shard_log import ShardLog
from regen_service.state.storage import RunLayout, Storage
from regen_service.work.client.auth import scrub_secrets
from regen_service.work.metrics import SHARDS_FINISHED, SHARDS_IN_PROGRESS, count_row
from regen_service.work.runtime import WorkerRuntime
from regen_service.work.shard_session import ShardSession
from schemas.prompt_rows import prompts_from_table
from schemas.rows import OutputRow, output_rows, output_table

log = logging.getLogger(__name__)


class ShardBusy(Exception):
    """Another live worker holds this shard's lease; try again after it could have expired."""


@dataclass
class ShardOutcome:
    run_id: str
    shard_id: int
    status: str  # done | already_done
    num_rows: int = 0
    num_asked: int = 0
    num_skipped: int = 0
    num_errors: int = 0
    tokens: int = 0
    seconds: float = 0.0
    top_errors: list[tuple[str, int]] = field(default_factory=list)  # (class: reason, rows), most first


def one_line(text: str, limit: int = 160) -> str:
    """Server or exception text made safe for one log or status line: secrets scrubbed first (a cut
    must not leave part of a key), control characters escaped (no forged lines), then cut."""
    text = scrub_secrets(text)
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def top_errors(rows: list[OutputRow], n: int = 3) -> list[tuple[str, int]]:
    """The shard's most frequent row errors, as `class: reason` lines with their counts."""
    reasons = Counter(f"{r.error_class or 'error'}: {one_line(r.error, 100)}" for r in rows if r.error)
    return reasons.most_common(n)


def process_shard(
    runtime: WorkerRuntime, run_id: str, shard_id: int, *, redo_errors: str | None = None
) -> ShardOutcome:
    settings = runtime.settings
    t0 = time.monotonic()
    ledger = Ledger(settings)
    layout = RunLayout(Storage(settings.data_root_resolved), run_id)
    storage = layout.storage
    if storage.exists(layout.output_shard(shard_id)) and not redo_errors:
        ev = mark_done_from_file(ledger, layout, shard_id)
        return ShardOutcome(run_id, shard_id, "already_done", num_rows=ev.num_rows)

    owner = owner_token(runtime.config.hostname)
    if not ledger.acquire_lease(run_id, shard_id, owner):
        raise ShardBusy(f"shard {run_id}/{shard_id} is held by {ledger.lease_holder(run_id, shard_id)}")
    SHARDS_IN_PROGRESS.inc()
    try:
        mix = load_run_mix(layout)
        runtime.check_mix(mix, layout.resolved_mix_path)  # before any of the mix's settings is used
        records = prompts_from_table(storage.read_table(layout.prompt_shard(shard_id)))
        shard_log = ShardLog(
            layout,
            shard_id,
            owner,
            flush_rows=runtime.config.shard_log.flush_rows,
            flush_interval_s=runtime.config.shard_log.flush_interval_s,
        )
        prog = Progress(rows={})
        if redo_errors and storage.exists(layout.output_shard(shard_id)):
            prior = output_rows(storage.read_table(layout.output_shard(shard_id)))
            for row in prior:
                if not _should_redo(row, redo_errors):
                    prog.add(row, new=False)
        for row in shard_log.load().values():
            prog.add(row, new=False)
        pending = {r.prompt_id for r in records if r.prompt_id not in prog.rows}
        for row in reused_rows(layout, pending).values():
            shard_log.append(row)  # durable like an answer, so a crash does not lose the copy
            prog.add(row, new=False)
            count_row(row)
        todo = [r for r in records if r.prompt_id not in prog.rows]
        # Endpoints first: a worker that cannot serve hands the shard back without marking it running.
        regenerator, budget = runtime.regenerator_for(mix, layout)
        ledger.set_shard_state(run_id, shard_id, "running")
        record_progress(ledger, run_id, shard_id, prog)
        num_skipped = len(prog.rows)
        runtime.intake.shard_started(len(todo))
        session = ShardSession(runtime, ledger, run_id, shard_id, owner, prog, shard_log, regenerator, budget)
        try:
            runtime.call(session.answer_all(todo))
        except EndpointTerminalError:
            # Every endpoint stopped mid-shard (bad key, wrong model): keep the rows answered so far,
            # leave the shard unfinished and queued; the task hands it back.
            shard_log.close()
            record_progress(ledger, run_id, shard_id, prog)
            ledger.set_shard_state(run_id, shard_id, "queued")
            raise
        finally:
            runtime.intake.shard_finished(len(todo) - session.num_answered)
        shard_log.close()
        ordered = [prog.rows[r.prompt_id] for r in records if r.prompt_id in prog.rows]
        if len(ordered) != len(records):  # pragma: no cover - every prompt yields a row, error or not
            raise RuntimeError(f"shard {shard_id}: {len(records) - len(ordered)} prompts have no row")
        if not ledger.extend_lease(run_id, shard_id, owner):
            raise LeaseLostError(f"lease on {run_id}/{shard_id} lost before finalizing")
        # A run whose mix keeps images writes the images column on every shard (one schema per run).
        final = output_table(ordered, images=mix.images is not None)
        storage.write_table_atomic(layout.output_shard(shard_id), final)
        shard_log.remove()
        ev = announce_done(ledger, layout, shard_id, prog)
        SHARDS_FINISHED.inc()
        return ShardOutcome(
            run_id,
            shard_id,
            "done",
            num_rows=len(ordered),
            num_asked=len(todo),
            num_skipped=num_skipped,
            num_errors=ev.num_errors,
            tokens=prog.tokens,
            seconds=time.monotonic() - t0,
            top_errors=top_errors(ordered),
        )
    finally:
        SHARDS_IN_PROGRESS.dec()
        ledger.release_lease(run_id, shard_id, owner)


def _should_redo(row: OutputRow, redo_errors: str) -> bool:
    if not row.error:
        return False
    return redo_errors == "all" or row.error_class == "retries_exhausted"
