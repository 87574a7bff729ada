"""The Celery app of regen's workers, for `celery -A workers.celery_app worker|flower ...`.

Built from the environment's Settings (REGEN_*), so these commands get the same broker settings as
`regen worker` and `regen flower`. Everything it does lives in regen_service.work.worker_app.
"""

from __future__ import annotations

from regen_service.settings import Settings
from regen_service.work.worker_app import WorkerApp

worker = WorkerApp(Settings.from_env())
app = worker.app
process_shard_task = worker.task
