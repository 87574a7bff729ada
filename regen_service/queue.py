"""Celery configuration shared by every client of the broker, and the task-sending side.

Workers, the producer, `regen resume` and Flower all build their Celery app here from one Settings, so
they agree on what matters for exactly-once (celery#5935, #3430, #5306): JSON only (never pickle),
`acks_late` with `task_reject_on_worker_lost` (a killed worker's shard goes back to the queue instead of
being acked), prefetch 1 (a worker never hoards shards it is not working on), and ONE visibility
timeout: a client with a shorter one would requeue everyone's in-flight shards. Leases (ledger) make a
redelivered duplicate harmless. The task bodies live in workers/celery_app.py.
"""

from __future__ import annotations

from celery import Celery
from kombu import Queue

from regen_service.settings import Settings

PROCESS_SHARD = "regen.process_shard"


def celery_config(settings: Settings) -> dict:
    transport = {
        "visibility_timeout": settings.visibility_timeout_s,
        "global_keyprefix": f"{settings.key_prefix}:celery:",
        "health_check_interval": 30,
    }
    return {
        "broker_url": settings.redis_url,
        "broker_transport_options": transport,
        "broker_connection_retry_on_startup": True,
        # rediss:// needs explicit cert settings; requiring verification is the safe default.
        **(
            {"broker_use_ssl": {"ssl_cert_reqs": "required"}}
            if settings.redis_url.startswith("rediss://")
            else {}
        ),
        "result_backend": None,
        "task_ignore_result": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        "task_default_queue": settings.queue_name,
        "task_queues": [Queue(settings.queue_name)],
        "task_routes": {PROCESS_SHARD: {"queue": settings.queue_name}},
        "task_track_started": True,
        "task_send_sent_event": True,
        "worker_send_task_events": True,
        "worker_hijack_root_logger": False,
        "worker_redirect_stdouts": False,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
    }


def make_celery(settings: Settings, name: str = "regen") -> Celery:
    app = Celery(name, set_as_current=False)
    app.conf.update(celery_config(settings))
    return app


def shard_task_name(run_id: str, shard_id: int) -> str:
    """What Flower shows for a shard's task: the run and the shard, readable at a glance."""
    return f"regen.shard[{run_id}/{shard_id:05d}]"


def send_shard(app: Celery, run_id: str, shard_id: int, *, redo_errors: str | None = None) -> str:
    """Queue one shard. The message carries references only, never rows."""
    kwargs = {"redo_errors": redo_errors} if redo_errors else {}
    res = app.send_task(
        PROCESS_SHARD,
        args=[run_id, shard_id],
        kwargs=kwargs,
        shadow=shard_task_name(run_id, shard_id),
    )
    return res.id
