"""Stage 3, train: the EAGLE-3 draft trained from a run's output shards.

consumer.py reads the run's shard_done stream (a consumer group: no shard twice); loop.py drives
training shard by shard with checkpoints (`train_from_run`); data.py renders output rows into ids and
loss masks; target.py / engine_target.py give the target's hidden states (a local copy or a vLLM
engine); model.py, layers.py, mla_attention.py and rope.py are the draft model; trainer.py
(`DraftTrainer`), ttt.py, loss.py and optim.py its optimisation step. What a draft is on disk (its
config, the checkpoint, the engines' formats, export, validation, conversion) is regen_service.draft's:
train imports draft, never the reverse.
"""
