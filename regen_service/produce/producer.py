"""`regen enqueue`: a mix file becomes a run in storage, a record in the ledger and one task per shard.

Reading and normalizing the datasets is regen_service.produce.prepare's job; this module decides the run id,
makes enqueueing idempotent (the same mix again creates no new tasks and says so), and sends the tasks,
which carry only (run id, shard id).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from regen_service.errors import ConfigError
from regen_service.produce.data_report import source_report, source_warnings
from regen_service.produce.prepare import prepare_run, run_id_for
from regen_service.remote_code import require_opt_in
from regen_service.settings import Settings
from regen_service.state.ledger import Ledger, check_reachable
from regen_service.state.queue import PRIORITY_RESUME, make_celery, send_shard
from regen_service.state.runinfo import done_shards_in_storage, load_manifest, resolved_mix_dict
from regen_service.state.storage import RunLayout, Storage, check_data_root
from schemas.mix import load_mix
from schemas.records import RunManifest


@dataclass
class EnqueueResult:
    run_id: str
    created: bool  # False: this mix was already enqueued, nothing new was sent
    num_tasks_sent: int
    num_shards: int
    num_prompts: int
    run_dir: str
    sources: dict  # per source: counts, quarantined fraction, top quarantine reasons (data_report)
    message: str

    def as_dict(self) -> dict:
        return asdict(self)


def _redo_run_id(storage: Storage, run_id: str) -> str:
    """The first of `<run id>-r2`, `-r3`, ... not prepared yet: a new run of the same mix."""
    n = 2
    while storage.exists(RunLayout(storage, f"{run_id}-r{n}").manifest_path):
        n += 1
    return f"{run_id}-r{n}"


def prepare_or_load(
    settings: Settings, mix_path: str | Path, *, reuse: bool = True, redo: bool = False
) -> tuple[RunLayout, RunManifest]:
    """The run of this mix, prepared now unless its manifest exists. With `redo`, a run of this mix that
    was prepared already gets a new run (id `<run id>-rN`) instead, asking every prompt again."""
    mix = load_mix(mix_path)
    if mix.target.api == "generate" and mix.target.tokenizer and Path(mix.target.tokenizer).is_dir():
        # The workers will load it: say now, not on the first shard, that it needs the opt-in.
        require_opt_in(mix.target.tokenizer, mix.target.trust_remote_code, "target.trust_remote_code: true")
    run_id = run_id_for(mix)
    storage = Storage(settings.data_root_resolved)
    layout = RunLayout(storage, run_id)
    if redo and storage.exists(layout.manifest_path):
        layout, reuse = RunLayout(storage, _redo_run_id(storage, run_id)), False
    if storage.exists(layout.manifest_path):
        return layout, load_manifest(layout)
    try:
        storage.write_json_atomic(layout.resolved_mix_path, resolved_mix_dict(mix))
        # reuse is planned before anything is queued, and counted in the one manifest status and resume read
        manifest = prepare_run(
            mix, storage, layout.run_id, Path(mix_path).read_text(encoding="utf-8"), reuse=reuse
        )
    except BaseException:
        # A run exists once its manifest does: leave no half-prepared folder that `runs` would list.
        if not storage.exists(layout.manifest_path):
            storage.remove(layout.run_dir, recursive=True)
        raise
    return layout, manifest


def enqueue(
    settings: Settings,
    mix_path: str | Path,
    *,
    reuse: bool = True,
    strict_fraction: float | None = None,
    redo: bool = False,
) -> EnqueueResult:
    """With strict_fraction, a source that keeps nothing or quarantines more than that fraction stops
    the run before anything is queued (ConfigError naming the sources); the prepared files stay.
    With redo, an already prepared mix becomes a new run that asks every prompt again."""
    check_reachable(settings)  # before anything is written to the data root
    check_data_root(settings.data_root_resolved)
    layout, manifest = prepare_or_load(settings, mix_path, reuse=reuse, redo=redo)
    sources = source_report(layout, manifest)
    if strict_fraction is not None and (warnings := source_warnings(sources, strict_fraction)):
        raise ConfigError(
            f"not queued (--strict): {'; '.join(warnings)}. The rows are in {layout.quarantine_path}; fix "
            "the mix, or enqueue without --strict to run what was kept"
        )
    ledger = Ledger(settings)
    done = done_shards_in_storage(layout, manifest)
    if not ledger.register_run(manifest, layout.storage.url, done_shards=done):
        requeued = _reconcile(settings, ledger, layout, manifest, done)
        if requeued:
            return EnqueueResult(
                manifest.run_id,
                False,
                requeued,
                manifest.num_shards,
                manifest.num_prompts,
                layout.run_dir,
                sources,
                f"run {manifest.run_id} was already enqueued; {requeued} shards the ledger counted as done "
                "have no output file under the data root and were queued again (storage is the truth)",
            )
        return EnqueueResult(
            manifest.run_id,
            False,
            0,
            manifest.num_shards,
            manifest.num_prompts,
            layout.run_dir,
            sources,
            f"run {manifest.run_id} was already enqueued; no new tasks (see `regen status {manifest.run_id}`)"
            + ("" if reuse else "; --no-reuse only applies to a new run: `regen enqueue --redo MIX` makes one"
               " that asks every prompt again"),
        )  # fmt: skip
    sent = send_pending(settings, manifest, done)
    return EnqueueResult(
        manifest.run_id,
        True,
        sent,
        manifest.num_shards,
        manifest.num_prompts,
        layout.run_dir,
        sources,
        f"run {manifest.run_id}: {manifest.num_prompts} prompts in {manifest.num_shards} shards, "
        f"{manifest.num_reused} reused from earlier runs, {sent} tasks sent",
    )


def _reconcile(
    settings: Settings, ledger: Ledger, layout: RunLayout, manifest: RunManifest, done: set[int]
) -> int:
    """The run is known to the ledger: refuse another data root's record, and re-queue shards the ledger
    calls done whose output files are missing here. Returns how many shards were queued again."""
    record = ledger.run_record(manifest.run_id) or {}
    if record.get("data_root") and record["data_root"] != layout.storage.url:
        raise ConfigError(
            f"run {manifest.run_id} is registered in Redis ({settings.redis_url_redacted}, prefix "
            f"{settings.key_prefix!r}) for the data root {record['data_root']}, not {layout.storage.url}. "
            "Use the same REGEN_DATA_ROOT, or give this data root its own REGEN_KEY_PREFIX."
        )
    missing = [
        sid
        for sid, state in ledger.shard_states(manifest.run_id).items()
        if state == "done" and sid not in done
    ]
    if not missing:
        return 0
    app = make_celery(settings)
    with app.producer_or_acquire():
        for sid in missing:
            ledger.set_shard_state(manifest.run_id, sid, "queued")
            send_shard(app, manifest.run_id, sid, priority=PRIORITY_RESUME)
    return len(missing)


def send_pending(settings: Settings, manifest: RunManifest, done: set[int]) -> int:
    app = make_celery(settings)
    sent = 0
    with app.producer_or_acquire():
        for shard in manifest.shards:
            if shard.shard_id not in done:
                send_shard(app, manifest.run_id, shard.shard_id)
                sent += 1
    return sent
