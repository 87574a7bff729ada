"""Stage 2, work: a worker turns one prompt shard into one output shard, exactly once.

worker_app.py is the Celery app and its one task; intake.py decides how many shards a worker holds;
shard_runner.py takes the lease, asks the target for every prompt and writes the output shard;
regenerate.py answers one prompt record (all turns or the last) into an OutputRow; chat_template.py
renders prompts for `api: generate` and parses raw output; client/ is the endpoint pool that talks to
SGLang and vLLM; runtime.py holds a worker's event loop, pools and in-flight budget. Durable progress
and the ledger are regen_service.state's.
"""
