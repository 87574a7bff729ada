"""Stage 2, work: a worker turns one prompt shard into one output shard, exactly once.

worker_app.py is the Celery app and its one task; intake.py decides how many shards a worker holds;
shard_runner.py takes the lease, resumes from the shard log, and writes the output shard; shard_session.py
asks the target for every pending prompt while the lease holds;
regenerate.py answers one prompt record (all turns or the last) into an OutputRow; chat_template.py
renders prompts for `api: generate` and parses raw output; client/ is the endpoint pool that talks to
SGLang and vLLM; runtime.py holds a worker's event loop, pools and in-flight budget; worker_config.py
is everything a worker is started with. Prompt shards are read through schemas.prompt_rows (work
imports no produce module); durable progress and the ledger are regen_service.state's.
"""
