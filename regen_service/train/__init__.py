"""Stage 3, train: the EAGLE-3 draft trained from a run's output shards, exported and validated.

consumer.py reads the run's shard_done stream (a consumer group: no shard twice); runner.py drives
training shard by shard with checkpoints; data.py renders output rows into ids and loss masks;
target.py / engine_target.py give the target's hidden states (a local copy or a vLLM engine);
model.py, layers.py, mla_attention.py, ttt.py, loss.py, optim.py and train.py are the draft and its
step; export.py, validate*.py, sglang_format.py, mla_format.py and convert.py speak the engines'
checkpoint formats.
"""
