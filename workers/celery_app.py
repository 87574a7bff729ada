"""The Celery app of regen's workers and its one task. Thin: the work is regen_service.shard_runner's.

`regen worker` configures the runtime (endpoints, in-flight limits) and starts this app's worker with a
thread pool; the documented `celery -A workers.celery_app ...` commands (Flower included) get the
same broker settings because the app is built by regen_service.queue from the same Settings.
"""

from __future__ import annotations

import logging
from dataclasses import asdict

from celery.exceptions import Reject
from celery.signals import worker_shutdown

from regen_service.errors import ConfigError, EndpointTerminalError, LeaseLostError
from regen_service.ledger import Ledger
from regen_service.queue import PROCESS_SHARD, make_celery
from regen_service.runtime import WorkerConfig, WorkerRuntime
from regen_service.settings import Settings
from regen_service.shard_runner import ShardBusy, process_shard
from regen_service.storage import check_run_id

log = logging.getLogger("regen.worker")

settings = Settings.from_env()
app = make_celery(settings)
_runtime: WorkerRuntime | None = None
_config: WorkerConfig | None = None


def configure(worker_settings: Settings, config: WorkerConfig) -> None:
    """Called by `regen worker` before the worker starts; the runtime is built on first use."""
    global settings, _config
    settings = worker_settings
    app.conf.update(make_celery(worker_settings).conf)
    _config = config


def runtime() -> WorkerRuntime:
    global _runtime
    if _runtime is None:
        if _config is None:
            raise RuntimeError("this worker has no endpoints: start it with `regen worker --endpoint URL`")
        _runtime = WorkerRuntime(settings, _config)
    return _runtime


@worker_shutdown.connect
def _close_runtime(**_kw) -> None:
    if _runtime is not None:
        _runtime.close()


@app.task(name=PROCESS_SHARD, bind=True, max_retries=None, acks_late=True, reject_on_worker_lost=True)
def process_shard_task(self, run_id: str, shard_id: int, redo_errors: str | None = None) -> dict:
    try:
        # Anyone who can reach the broker (or Flower) can send a task: check what it names first.
        check_run_id(run_id)
        if isinstance(shard_id, bool) or not isinstance(shard_id, int) or shard_id < 0:
            raise ConfigError(f"invalid shard id {shard_id!r}: a shard id is an integer >= 0")
        if redo_errors not in (None, "exhausted", "all"):
            raise ConfigError(f"invalid redo_errors {redo_errors!r}: one of None, 'exhausted', 'all'")
    except ConfigError as exc:
        log.error("refused a task: %s", exc)
        raise Reject(str(exc), requeue=False) from None
    try:
        outcome = process_shard(runtime(), run_id, shard_id, redo_errors=redo_errors)
    except (ShardBusy, LeaseLostError) as exc:
        # Someone else is (or just became) the holder. Keep the message circulating until the shard is
        # done: if that holder dies, this retry takes the shard over once its lease expires.
        raise self.retry(exc=exc, countdown=settings.lease_ttl_s) from None
    except EndpointTerminalError as exc:
        # These endpoints cannot serve this run (wrong model, bad key): hand the shard back for another
        # worker and stop consuming here, rather than failing the shard. Handed back means: the shard is
        # not finalized (no output file, no row marked), its state is `queued` again, the rows answered
        # so far stay in its shard log, and the message returns to the queue for another worker.
        log.error("stopping consumption: %s", exc)
        app.control.cancel_consumer(settings.queue_name, destination=[self.request.hostname])
        raise Reject(str(exc), requeue=True) from None
    except Exception as exc:
        attempt = self.request.retries
        if attempt >= 5:
            Ledger(settings).set_shard_state(run_id, shard_id, "failed")
            log.exception("shard %s/%s failed after %d attempts", run_id, shard_id, attempt + 1)
            raise
        log.exception("shard %s/%s: attempt %d failed, retrying", run_id, shard_id, attempt + 1)
        raise self.retry(exc=exc, countdown=min(60, 2**attempt)) from None
    log.info(
        "shard %s/%05d %s: %d rows (%d asked, %d kept from before)",
        run_id,
        shard_id,
        outcome.status,
        outcome.num_rows,
        outcome.num_asked,
        outcome.num_skipped,
    )
    return asdict(outcome)
