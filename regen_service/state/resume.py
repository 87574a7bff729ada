"""`regen resume` and `regen retry-failed`: storage is the truth, Redis is rebuilt from it.

resume: for a run on the data root, re-register it in the ledger (after a wipe or on a new Redis),
mark shards whose output file exists as done, restore per-shard progress from their shard logs, and
queue each unfinished shard that is neither held by a live lease nor already waiting in the queue, so
running it any number of times queues nothing twice. retry-failed: queue shards whose output has
rows that exhausted their retries (terminal errors too with include_terminal) to be asked again.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import asdict, dataclass, field

from regen_service.settings import Settings
from regen_service.state.ledger import Ledger
from regen_service.state.progress import Progress, mark_done_from_file, record_progress
from regen_service.state.queue import PRIORITY_RESUME, make_celery, send_shard, waiting_shard_ids
from regen_service.state.runinfo import done_shards_in_storage, load_manifest
from regen_service.state.shard_log import ShardLog
from regen_service.state.storage import RunLayout, Storage
from schemas.rows import output_rows


@dataclass
class ResumeResult:
    run_id: str
    shards_total: int
    shards_done: int
    shards_sent: list[int] = field(default_factory=list)
    shards_leased: list[int] = field(default_factory=list)
    shards_already_queued: list[int] = field(default_factory=list)
    ledger_rebuilt: bool = False
    lease_frees_in_s: float | None = None  # the longest a held shard's lease has left (None: none held)

    def as_dict(self) -> dict:
        return asdict(self)


def restore_ledger(settings: Settings, ledger: Ledger, layout: RunLayout) -> tuple[set[int], bool]:
    """Make the ledger agree with storage: the manifest's shards only, done where the output file is."""
    manifest = load_manifest(layout)
    done = done_shards_in_storage(layout, manifest)
    rebuilt = ledger.register_run(manifest, layout.storage.url, done_shards=done)
    for sid in done:
        mark_done_from_file(ledger, layout, sid)
    states = ledger.shard_states(layout.run_id)
    # A shard the manifest does not list (an old worker counted a task naming [run, 99999]) is no part
    # of the run: forget it, or it keeps a finished run `failed` for good.
    ledger.drop_shards(layout.run_id, set(states) - {s.shard_id for s in manifest.shards})
    for shard in manifest.shards:
        sid = shard.shard_id
        if sid in done:
            continue
        if states.get(sid) == "done":  # the ledger says done but the file is gone: storage wins
            ledger.set_shard_state(layout.run_id, sid, "queued")
        prog = Progress(rows={})
        for row in ShardLog(layout, sid, owner="resume").load().values():
            prog.add(row, new=False)
        record_progress(ledger, layout.run_id, sid, prog)
    return done, rebuilt


def _stored_run(settings: Settings, run_id: str) -> RunLayout:
    layout = RunLayout(Storage(settings.data_root_resolved), run_id)
    if not layout.storage.exists(layout.manifest_path):
        raise FileNotFoundError(
            f"no run {run_id!r} under {layout.storage.url}/runs (check REGEN_DATA_ROOT; `regen runs` lists runs)"
        )
    return layout


@dataclass
class Requeued:
    """What queue_unheld did with each shard it was given."""

    sent: list[int] = field(default_factory=list)
    leased: list[int] = field(default_factory=list)
    already_queued: list[int] = field(default_factory=list)
    lease_frees_in_s: float | None = None  # the longest a held shard's lease has left (None: none held)


def queue_unheld(
    ledger: Ledger, app, run_id: str, shard_ids: Iterable[int], covered: Collection[int]
) -> Requeued:
    """Queue each of `shard_ids` that no lease holds and no message in `covered` stands for, ahead of
    the shards of runs not yet started. `regen resume` and the dead-holder sweep (state/reclaim.py)
    both come here, so a shard is given back the same way whoever notices it is lost.

    Delivered-but-unacked messages do not count as covering a shard unless the caller knows a live
    worker holds them: without a live lease their holder is dead, and the message would only come back
    after the visibility timeout. Sending another is harmless: the lease and the final shard's
    existence stop a second copy from running twice."""
    out = Requeued()
    ids = list(shard_ids)
    if not ids:
        return out
    held = ledger.leases(run_id, ids)
    with app.producer_or_acquire():
        for sid in ids:
            if sid in held:
                out.leased.append(sid)
                # A killed worker's lease runs out by itself: say when, so the operator knows when a
                # second `regen resume` (or the sweep) will queue the shard.
                left_s = held[sid][1]
                if left_s is not None:
                    out.lease_frees_in_s = max(out.lease_frees_in_s or 0.0, round(left_s, 1))
            elif sid in covered:
                out.already_queued.append(sid)
            else:
                ledger.set_shard_state(run_id, sid, "queued")
                send_shard(app, run_id, sid, priority=PRIORITY_RESUME)
                out.sent.append(sid)
    return out


def resume_run(settings: Settings, run_id: str) -> ResumeResult:
    layout = _stored_run(settings, run_id)
    ledger = Ledger(settings)
    done, rebuilt = restore_ledger(settings, ledger, layout)
    manifest = load_manifest(layout)
    result = ResumeResult(run_id, manifest.num_shards, len(done), ledger_rebuilt=rebuilt)
    queued = waiting_shard_ids(settings, ledger.r, run_id)
    todo = [s.shard_id for s in manifest.shards if s.shard_id not in done]
    req = queue_unheld(ledger, make_celery(settings), run_id, todo, queued)
    result.shards_sent, result.shards_leased = req.sent, req.leased
    result.shards_already_queued, result.lease_frees_in_s = req.already_queued, req.lease_frees_in_s
    return result


def retry_failed(settings: Settings, run_id: str, include_terminal: bool = False) -> dict:
    layout = _stored_run(settings, run_id)
    ledger = Ledger(settings)
    done, _ = restore_ledger(settings, ledger, layout)
    app = make_celery(settings)
    mode = "all" if include_terminal else "exhausted"
    sent: dict[int, int] = {}
    for sid in sorted(done):
        rows = output_rows(
            layout.storage.read_table(layout.output_shard(sid)).select(["error", "error_class"])
        )
        n = sum(1 for r in rows if r.error and (include_terminal or r.error_class == "retries_exhausted"))
        if n:
            ledger.set_shard_state(run_id, sid, "queued")
            send_shard(app, run_id, sid, redo_errors=mode, priority=PRIORITY_RESUME)
            sent[sid] = n
    return {
        "run_id": run_id,
        "mode": mode,
        "shards_sent": len(sent),
        "rows_to_retry": sum(sent.values()),
        "per_shard": sent,
    }
