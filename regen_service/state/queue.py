"""Celery configuration shared by every client of the broker, and the task-sending side.

Workers, the producer, `regen resume` and Flower all build their Celery app here from one Settings, so
they agree on what matters for exactly-once (celery#5935, #3430, #5306): JSON only (never pickle),
`acks_late` with `task_reject_on_worker_lost` (a killed worker's shard goes back to the queue instead of
being acked), prefetch 1 (a worker never hoards shards it is not working on), and ONE visibility
timeout: a client with a shorter one would requeue everyone's in-flight shards. Leases (ledger) make a
redelivered duplicate harmless. This module also owns the wire format: what a shard message looks
like in kombu's Redis lists (`waiting_shard_ids` reads it back). The task bodies live in
regen_service.work.worker_app.

Priorities: kombu's Redis transport keeps one list per priority step and pops them in step order, so a
shard sent with PRIORITY_RESUME (a resumed or re-queued shard of a run already in progress) is taken
before every PRIORITY_NEW shard of a run just enqueued; within one step the queue stays FIFO.
"""

from __future__ import annotations

import base64
import json

import redis
from celery import Celery
from kombu import Queue

from regen_service.settings import Settings

PROCESS_SHARD = "regen.process_shard"
PRIORITY_STEPS = [0, 3, 6, 9]  # kombu's Redis default, named here because queue_keys() depends on it
PRIORITY_RESUME = 0  # lower is taken first on Redis
PRIORITY_NEW = 6
_PRIORITY_SEP = "\x06\x16"  # kombu.transport.redis.Channel.sep


def queue_keys(settings: Settings) -> list[str]:
    """The Redis lists that hold waiting shard messages, highest priority first."""
    base = f"{settings.key_prefix}:celery:{settings.queue_name}"
    return [base if pri == 0 else f"{base}{_PRIORITY_SEP}{pri}" for pri in PRIORITY_STEPS]


def celery_config(settings: Settings) -> dict:
    transport = {
        "visibility_timeout": settings.visibility_timeout_s,
        "global_keyprefix": f"{settings.key_prefix}:celery:",
        "health_check_interval": 30,
        "priority_steps": PRIORITY_STEPS,
    }
    return {
        "broker_url": settings.redis_url,
        "broker_transport_options": transport,
        "broker_connection_retry_on_startup": True,
        # rediss:// needs explicit cert settings; requiring verification is the safe default.
        **({"broker_use_ssl": ssl} if (ssl := settings.redis_ssl_options()) else {}),
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


def send_shard(
    app: Celery, run_id: str, shard_id: int, *, redo_errors: str | None = None, priority: int = PRIORITY_NEW
) -> str:
    """Queue one shard. The message carries references only, never rows."""
    kwargs = {"redo_errors": redo_errors} if redo_errors else {}
    res = app.send_task(
        PROCESS_SHARD,
        args=[run_id, shard_id],
        kwargs=kwargs,
        shadow=shard_task_name(run_id, shard_id),
        priority=priority,
    )
    return res.id


def waiting_shard_ids(settings: Settings, client: redis.Redis, run_id: str) -> set[int]:
    """Shards of this run with a message waiting in the queue's Redis lists (see waiting_shards)."""
    return waiting_shards(settings, client).get(run_id, set())


def waiting_shards(settings: Settings, client: redis.Redis) -> dict[str, set[int]]:
    """Run id -> shards with a message waiting in the queue's Redis lists (kombu's envelope: JSON, the
    body base64 when body_encoding says so, the task's args first). Messages this regen did not write
    are skipped. Delivered-but-unacked messages are not in these lists, so they do not count."""
    found: dict[str, set[int]] = {}
    for key in queue_keys(settings):
        for item in client.lrange(key, 0, -1):
            try:
                msg = json.loads(item)
                body = msg["body"]
                if msg.get("properties", {}).get("body_encoding") == "base64":
                    body = base64.b64decode(body)
                ref = shard_ref(json.loads(body)[0])
            except (ValueError, KeyError, IndexError, TypeError):
                continue
            if ref is not None:
                found.setdefault(ref[0], set()).add(ref[1])
    return found


def shard_ref(args) -> tuple[str, int] | None:
    """(run id, shard id) of a shard task's args as sent by send_shard; None for anything else."""
    if not isinstance(args, (list, tuple)) or len(args) < 2:
        return None
    run_id, shard_id = args[0], args[1]
    if not isinstance(run_id, str) or isinstance(shard_id, bool) or not isinstance(shard_id, int):
        return None
    return run_id, shard_id
