"""Benchmarks that run the whole flow in one process (produce -> work -> train), above the stages.

A stage may not import another stage's downstream (tests/test_import_boundaries.py); a benchmark that
builds prompts, regenerates them and trains on the result needs all three, so it lives here, beside the
stages rather than inside one. scripts/bench_*.py stay thin and call into it. train_flops.py is the
training benchmark's FLOP accounting, torch-free so a summary of result lines imports it anywhere.
"""
