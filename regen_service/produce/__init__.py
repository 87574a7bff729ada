"""Stage 1, produce: a mix file becomes a prepared run in storage and one task per shard on the queue.

sources/ reads each dataset format and normalizes a row into a PromptRecord (or a quarantine reason);
prepare.py samples, dedups and shards them into prompt shards with a manifest written last; reuse.py maps
prompts already answered under the same data root; producer.py (`regen enqueue`) names the run,
registers it in the ledger and sends the tasks; data_report.py says what each source kept. The prompt
shard's table codec is schemas.prompt_rows (the worker reads it too). What happens to a shard after it is queued is regen_service.work's.
"""
