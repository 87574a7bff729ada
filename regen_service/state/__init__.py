"""State: where a run lives and what is known of it, shared by every stage.

storage.py owns the data root and every run path (RunLayout); ledger.py owns every Redis key of runs,
shards, counters, leases and the shard_done stream; queue.py owns the Celery configuration and its wire
format; shard_log.py and progress.py make a shard's answered rows durable and counted; runinfo.py reads a
run's own files back; reuse_map.py reads the rows a run reuses from others; resume.py rebuilds Redis from storage; status.py, presence.py and find_runs.py
answer the operator's questions. Storage is the truth; Redis is a cache of it.
"""
