"""The Celery app of regen's workers and its one task. Thin: the work is regen_service.shard_runner's.

`regen worker` configures the runtime (endpoints, in-flight limits) and starts this app's worker with a
thread pool; the documented `celery -A workers.celery_app ...` commands (Flower included) get the
same broker settings because the app is built by regen_service.queue from the same Settings.

Endpoints that cannot serve (down, or serving another model) stop consumption here and start
EndpointRecovery, which checks them again with backoff and consumes again once one is healthy; with
`exit_after_no_endpoint_s` it ends the worker with EXIT_NO_ENDPOINT so a supervisor restarts it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import asdict

from celery.exceptions import Reject
from celery.signals import worker_shutdown

from regen_service.errors import ConfigError, EndpointTerminalError, LeaseLostError, NoUsableEndpointError
from regen_service.intake import IntakeStep
from regen_service.ledger import Ledger
from regen_service.presence import Presence
from regen_service.queue import PROCESS_SHARD, make_celery
from regen_service.runtime import WorkerConfig, WorkerRuntime
from regen_service.settings import Settings
from regen_service.shard_runner import ShardBusy, process_shard
from regen_service.storage import check_run_id

log = logging.getLogger("regen.worker")

EXIT_NO_ENDPOINT = 3

settings = Settings.from_env()
app = make_celery(settings)
app.steps["consumer"].add(IntakeStep)
_runtime: WorkerRuntime | None = None
_runtime_lock = threading.Lock()  # Celery's thread pool runs the first tasks at once: build one runtime
_config: WorkerConfig | None = None
_presence: Presence | None = None
exit_code = 0  # read by `regen worker` after Celery returns


def configure(worker_settings: Settings, config: WorkerConfig | None) -> None:
    """Called by `regen worker` before the worker starts; builds the runtime (once per process)."""
    global settings, _config
    settings = worker_settings
    app.conf.update(make_celery(worker_settings).conf)
    _config = config
    if config is not None:
        runtime()  # before Celery's consumer starts: its IntakeStep needs the runtime's Intake


def runtime() -> WorkerRuntime:
    global _runtime, _presence
    with _runtime_lock:
        if _runtime is None:
            if _config is None:
                raise RuntimeError(
                    "this worker has no endpoints: start it with `regen worker --endpoint URL`"
                )
            _runtime = WorkerRuntime(settings, _config)
            IntakeStep.intake = _runtime.intake
            _presence = Presence(settings, _config.hostname or "regen", _config.endpoints)
        return _runtime


@worker_shutdown.connect
def _close_runtime(**_kw) -> None:
    if _runtime is not None:
        _runtime.close()
    if _presence is not None:
        _presence.close()


class EndpointRecovery:
    """Re-checks the endpoints of a model with backoff while consumption is stopped; one at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = False

    def start(self, model: str, reason: str, node: str) -> None:
        with self._lock:
            if self._running:
                return
            self._running = True
        app.control.cancel_consumer(settings.queue_name, destination=[node])
        if _presence is not None:
            _presence.set_state("no_endpoint", reason)
        threading.Thread(target=self._run, args=(model, node), name="regen-recovery", daemon=True).start()

    def _run(self, model: str, node: str) -> None:
        global exit_code
        rt = runtime()
        t0, delay_s = time.monotonic(), 1.0
        while True:
            limit = rt.config.exit_after_no_endpoint_s
            if limit is not None and time.monotonic() - t0 >= limit:
                log.error("no usable endpoint for %.0fs: exiting with %d so the supervisor restarts this "
                          "worker", limit, EXIT_NO_ENDPOINT)  # fmt: skip
                exit_code = EXIT_NO_ENDPOINT
                os.kill(os.getpid(), signal.SIGTERM)  # Celery's warm shutdown; `regen worker` sets the code
                return
            time.sleep(delay_s)
            delay_s = min(rt.config.endpoint_retry_max_s, delay_s * 2)
            try:
                rt.pool_for(model)
            except EndpointTerminalError as exc:
                log.warning("endpoints still unusable for %s (next check in %.0fs): %s", model, delay_s, exc)
                if _presence is not None:
                    _presence.set_state("no_endpoint", str(exc))
                continue
            log.info("endpoints for %s are usable again: consuming %s", model, settings.queue_name)
            if _presence is not None:
                _presence.set_state("consuming")
            with self._lock:
                self._running = False
            app.control.add_consumer(settings.queue_name, destination=[node])
            return


_recovery = EndpointRecovery()


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
    except NoUsableEndpointError as exc:
        # These endpoints cannot serve this run now (down, wrong model, bad key): hand the shard back
        # for another worker, stop consuming, and check the endpoints again until they can.
        log.error("stopping consumption until the endpoints are usable: %s", exc)
        _recovery.start(exc.model, str(exc), self.request.hostname)
        raise Reject(str(exc), requeue=True) from None
    except EndpointTerminalError as exc:
        # Every endpoint was stopped mid-shard (e.g. 401): hand the shard back for another worker and stop
        # consuming here, rather than failing the shard. Handed back means: the shard is not finalized (no
        # output file, no row marked), its state is `queued` again, the rows answered so far stay in its
        # shard log, and the message returns to the queue for another worker.
        log.error("stopping consumption: %s", exc)
        app.control.cancel_consumer(settings.queue_name, destination=[self.request.hostname])
        if _presence is not None:
            _presence.set_state("no_endpoint", str(exc))
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
