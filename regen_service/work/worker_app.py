"""A worker process's Celery app and its one task. Thin: the work is regen_service.work.shard_runner's.

`WorkerApp(settings, config)` builds the app from regen_service.state.queue (so every client agrees on the
broker settings), registers the shard task, and, given a WorkerConfig, the runtime (endpoints,
in-flight limits) before Celery's consumer starts. `regen worker` and `regen flower` build one here;
`celery -A workers.celery_app ...` finds the one workers/celery_app.py builds from the environment.
Parsing flags and starting processes are the entry points' job.

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

from celery import Task
from celery.exceptions import Reject
from celery.signals import worker_init, worker_shutdown
from celery.worker.request import Request

from regen_service.errors import (
    ConfigError,
    EndpointTerminalError,
    LeaseLostError,
    NoUsableEndpointError,
    TerminalError,
)
from regen_service.settings import Settings
from regen_service.state.ledger import Ledger
from regen_service.state.presence import Presence
from regen_service.state.queue import PROCESS_SHARD, make_celery, shard_task_name
from regen_service.state.reclaim import Sweeper
from regen_service.state.runinfo import check_shard_of_run
from regen_service.state.storage import RunLayout, Storage, check_run_id
from regen_service.work.intake import IntakeStep
from regen_service.work.runtime import WorkerRuntime
from regen_service.work.shard_runner import ShardBusy, one_line, process_shard
from regen_service.work.worker_config import WorkerConfig
from schemas.mix import MixError

log = logging.getLogger("regen.worker")

EXIT_NO_ENDPOINT = 3


class WorkerApp:
    """One process's Celery app, the runtime its task uses, and the exit code `regen worker` returns."""

    def __init__(self, settings: Settings, config: WorkerConfig | None = None):
        self.settings = settings
        self.app = make_celery(settings)
        self.app.steps["consumer"].add(IntakeStep)
        self.config = config
        self.exit_code = 0  # set by EndpointRecovery before it asks Celery to shut down
        self.presence: Presence | None = None
        self.sweeper: Sweeper | None = None
        self._runtime: WorkerRuntime | None = None
        self._runtime_lock = threading.Lock()  # Celery's thread pool runs the first tasks at once
        self.recovery = EndpointRecovery(self)
        self.task = _register_task(self)
        worker_shutdown.connect(self._close_runtime, weak=False)
        self.controller = None  # Celery's WorkController, for its exit code (worker_main drops it)
        worker_init.connect(self._keep_controller, weak=False)
        if config is not None:
            self.runtime()  # before Celery's consumer starts: its IntakeStep needs the runtime's Intake

    def runtime(self) -> WorkerRuntime:
        with self._runtime_lock:
            if self._runtime is None:
                if self.config is None:
                    raise RuntimeError(
                        "this worker has no endpoints: start it with `regen worker --endpoint URL`"
                    )
                self._runtime = WorkerRuntime(self.settings, self.config)
                IntakeStep.intake = self._runtime.intake
                self.presence = Presence(
                    self.settings, self.config.hostname or "regen", self.config.pool.endpoints
                )
                # Every worker takes part in giving a dead worker's shards back (one at a time).
                self.sweeper = Sweeper(self.settings, self.app)
            return self._runtime

    def _keep_controller(self, sender=None, **_kw) -> None:
        self.controller = sender

    def final_exit_code(self) -> int:
        """Ours (no endpoint) first, else Celery's: non-zero after an unrecoverable error such as a Redis
        that refuses writes (maxmemory under noeviction), so a supervisor sees the failure."""
        return self.exit_code or int(getattr(self.controller, "exitcode", 0) or 0)

    def set_presence(self, state: str, reason: str = "") -> None:
        if self.presence is not None:
            self.presence.set_state(state, reason)

    def _close_runtime(self, **_kw) -> None:
        if self._runtime is not None:
            self._runtime.close()
        if self.presence is not None:
            self.presence.close()
        if self.sweeper is not None:
            self.sweeper.close()

    def run_task(self, task: Task, run_id: str, shard_id: int, redo_errors: str | None) -> dict:
        settings = self.settings
        try:
            # Anyone who can reach the broker (or Flower) can send a task: check what it names first,
            # before anything is counted (a shard the manifest does not list must not reach the ledger).
            layout = RunLayout(Storage(settings.data_root_resolved), check_run_id(run_id))
            if isinstance(shard_id, bool) or not isinstance(shard_id, int) or shard_id < 0:
                raise ConfigError(f"invalid shard id {shard_id!r}: a shard id is an integer >= 0")
            if redo_errors not in (None, "exhausted", "all"):
                raise ConfigError(f"invalid redo_errors {redo_errors!r}: one of None, 'exhausted', 'all'")
            check_shard_of_run(layout, shard_id)
        except ConfigError as exc:
            # Acked as a failed task (Flower shows why), counted nowhere: the ledger never sees it.
            why = one_line(str(exc), 300)
            log.error("refused a task: %s", why)
            raise ShardFailedError(f"refused: {why}") from None
        try:
            outcome = process_shard(self.runtime(), run_id, shard_id, redo_errors=redo_errors)
        except (ShardBusy, LeaseLostError) as exc:
            # Someone else is (or just became) the holder. Keep the message circulating until the shard
            # is done: if that holder dies, this retry takes the shard over once its lease expires.
            raise task.retry(exc=exc, countdown=settings.lease_ttl_s) from None
        except NoUsableEndpointError as exc:
            # These endpoints cannot serve this run now (down, wrong model, bad key): hand the shard back
            # for another worker, stop consuming, and check the endpoints again until they can.
            log.error("stopping consumption until the endpoints are usable: %s", exc)
            self.recovery.start(exc.model, str(exc), task.request.hostname)
            raise Reject(str(exc), requeue=True) from None
        except EndpointTerminalError as exc:
            # Every endpoint was stopped mid-shard (e.g. 401): hand the shard back for another worker and
            # stop consuming here, rather than failing the shard. Handed back means: the shard is not
            # finalized (no output file, no row marked), its state is `queued` again, the rows answered so
            # far stay in its shard log, and the message returns to the queue for another worker.
            log.error("stopping consumption: %s", exc)
            self.app.control.cancel_consumer(settings.queue_name, destination=[task.request.hostname])
            self.set_presence("no_endpoint", str(exc))
            raise Reject(str(exc), requeue=True) from None
        except (ConfigError, MixError) as exc:
            # The run's own files say something this worker will not or cannot do (a stored mix asking
            # for remote code this worker was not started to allow, a mix.json that does not parse):
            # retrying cannot help. The shard fails now, with the reason in `regen status`; once the
            # cause is fixed, `regen resume` queues it again. Requeueing instead would pass it from
            # worker to worker forever with nobody told.
            why = one_line(str(exc), 500)
            Ledger(settings).set_shard_failed(run_id, shard_id, why)
            log.error("shard %s/%05d failed: %s", run_id, shard_id, why)
            raise ShardFailedError(why) from None
        except Exception as exc:
            attempt = task.request.retries
            if attempt >= 5:
                why = one_line(f"{type(exc).__name__}: {exc}", 500)
                Ledger(settings).set_shard_failed(run_id, shard_id, f"after {attempt + 1} attempts: {why}")
                log.exception("shard %s/%05d failed after %d attempts", run_id, shard_id, attempt + 1)
                raise
            log.exception("shard %s/%s: attempt %d failed, retrying", run_id, shard_id, attempt + 1)
            raise task.retry(exc=exc, countdown=min(60, 2**attempt)) from None
        log.info("shard %s/%05d %s: %d rows (%d asked, %d kept from before), %d failed%s", run_id, shard_id,
                 outcome.status, outcome.num_rows, outcome.num_asked, outcome.num_skipped, outcome.num_errors,
                 "".join(f"; {n}x {reason}" for reason, n in outcome.top_errors))  # fmt: skip
        return asdict(outcome)


class ShardFailedError(TerminalError):
    """The task ends failed for the reason it states: a shard failed (its state says so) or a task
    refused. An expected error for Celery: logged in one line, no traceback, acked, never retried."""


def _flower_name(args) -> str | None:
    """regen.shard[<run>/<shard>] for a task's args, or None when they name no valid shard."""
    try:
        run_id, shard_id = args[0], args[1]
        check_run_id(run_id)
    except (ConfigError, IndexError, KeyError, TypeError):
        return None
    if isinstance(shard_id, bool) or not isinstance(shard_id, int) or shard_id < 0:
        return None
    return shard_task_name(run_id, shard_id)


class ShardRequest(Request):
    """The worker's view of a shard message: named regen.shard[<run>/<shard>] in its events (what Flower
    shows) even when the sender (a Flower send-task, `celery call`) set no shadow name."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.name == self.type:
            try:
                name = _flower_name(self.args)
            except Exception:  # a message of any shape: naming it must never stop it being received
                name = None
            self.name = name or self.name


def _register_task(worker: WorkerApp):
    @worker.app.task(
        name=PROCESS_SHARD, bind=True, max_retries=None, acks_late=True, reject_on_worker_lost=True,
        throws=(ShardFailedError,), Request=ShardRequest,
        # a retry is sent with apply_async, which asks shadow_name: keep the shard's name in Flower
        shadow_name=lambda self, args, kwargs, options: _flower_name(args),
    )  # fmt: skip
    def process_shard_task(self, run_id: str, shard_id: int, redo_errors: str | None = None) -> dict:
        return worker.run_task(self, run_id, shard_id, redo_errors)

    return process_shard_task


class EndpointRecovery:
    """Re-checks the endpoints of a model with backoff while consumption is stopped; one at a time."""

    def __init__(self, worker: WorkerApp) -> None:
        self.worker = worker
        self._lock = threading.Lock()
        self._running = False

    def start(self, model: str, reason: str, node: str) -> None:
        with self._lock:
            if self._running:
                return
            self._running = True
        self.worker.app.control.cancel_consumer(self.worker.settings.queue_name, destination=[node])
        self.worker.set_presence("no_endpoint", reason)
        threading.Thread(target=self._run, args=(model, node), name="regen-recovery", daemon=True).start()

    def _run(self, model: str, node: str) -> None:
        worker, queue = self.worker, self.worker.settings.queue_name
        rt = worker.runtime()
        t0, delay_s = time.monotonic(), 1.0
        while True:
            limit = rt.config.bounds.exit_after_no_endpoint_s
            if limit is not None and time.monotonic() - t0 >= limit:
                log.error("no usable endpoint for %.0fs: exiting with %d so the supervisor restarts this "
                          "worker", limit, EXIT_NO_ENDPOINT)  # fmt: skip
                worker.exit_code = EXIT_NO_ENDPOINT
                os.kill(os.getpid(), signal.SIGTERM)  # Celery's warm shutdown; `regen worker` sets the code
                return
            time.sleep(delay_s)
            delay_s = min(rt.config.bounds.endpoint_retry_max_s, delay_s * 2)
            try:
                rt.pool_for(model)
            except EndpointTerminalError as exc:
                log.warning("endpoints still unusable for %s (next check in %.0fs): %s", model, delay_s, exc)
                worker.set_presence("no_endpoint", str(exc))
                continue
            log.info("endpoints for %s are usable again: consuming %s", model, queue)
            worker.set_presence("consuming")
            with self._lock:
                self._running = False
            worker.app.control.add_consumer(queue, destination=[node])
            return
