"""The variable-length training benchmark (scripts/bench_train.py --mode varlen) on the CPU at tiny shapes.

Sample lengths read off a run's output shards (one per answered turn, errored rows skipped), the seeded
built-in distribution, and the script end to end as a subprocess: its JSON record, padded lengths that
are the bucket rule's, real tokens counted apart from pads; and the script imports no pydantic.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

from regen_service.bench.varlen import builtin_lengths, draw, shard_lengths
from regen_service.train.fixtures import output_table
from regen_service.train.lengths import bucket_length
from regen_service.train.packing import pack_lengths

ROOT = Path(__file__).resolve().parents[2]


def _turn(prompt: int | None, completion: int | None) -> dict:
    return {"message_index": 1, "text": "x", "prompt_tokens": prompt, "completion_tokens": completion}


def _run_outputs(tmp_path: Path) -> Path:
    """A run folder with two output shards: per-turn counts, an errored row, a pretokenized row."""
    out = tmp_path / "run" / "outputs"
    out.mkdir(parents=True)
    rows0 = [
        {"prompt_id": "a", "turns": [_turn(60, 30), _turn(120, 40)]},  # 90, 160
        {"prompt_id": "b", "turns": [_turn(200, 20)], "error": "boom"},  # skipped
        {"prompt_id": "c", "input_ids": list(range(300)), "loss_mask": [1] * 300},  # no turns: 300
    ]
    rows1 = [{"prompt_id": "d", "turns": [_turn(150, 70), _turn(None, 5)]}]  # 220; no prompt count: skipped
    for i, rows in enumerate((rows0, rows1)):
        pq.write_table(output_table(rows), out / f"shard-{i:05d}.parquet")  # OUTPUT_SCHEMA
    (out / "notes.parquet").write_bytes(b"not a shard")  # not a shard name: never read
    return out


def test_sample_lengths_come_from_a_runs_output_shards(tmp_path):
    out = _run_outputs(tmp_path)
    assert sorted(shard_lengths(out)) == [90, 160, 220, 300]
    assert sorted(shard_lengths(out.parent)) == [90, 160, 220, 300]  # the run folder works too
    got = draw([90, 160, 220, 300], 50, 0, 200)
    assert got == draw([90, 160, 220, 300], 50, 0, 200) and set(got) <= {90, 160, 200}


def test_builtin_lengths_are_seeded_and_look_like_answers_with_thinking():
    xs = builtin_lengths(4000, seed=0)
    assert xs == builtin_lengths(4000, seed=0) and xs != builtin_lengths(4000, seed=1)
    assert min(xs) >= 200 and max(xs) <= 16384
    assert 2600 <= statistics.median(xs) <= 3400
    assert any(x == 16384 for x in xs) and any(x == 200 for x in xs)  # both tails reach the clip


def test_varlen_mode_end_to_end_on_the_cpu(tmp_path):
    out = _run_outputs(tmp_path)
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_train.py"), "--mode", "varlen", "--shapes", "tiny",
           "--steps", "6", "--ttt", "3", "--lengths-from", str(out), "--max-length", "256",
           "--length-bucket", "block"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads(res.stdout.strip().splitlines()[-1])
    assert rec["mode"] == "varlen" and rec["shapes"] == "tiny" and rec["device"] == "cpu"
    assert rec["steps"] == 6 and rec["length_bucket"] == "block" and rec["lengths_from"] == str(out)
    lengths = draw(shard_lengths(out), 6, 0, 256)
    assert rec["real_tokens"] == sum(lengths)
    assert rec["padded_tokens"] == sum(bucket_length(n, "block", 256) for n in lengths)
    assert rec["distinct_lengths"] == sorted({bucket_length(n, "block", 256) for n in lengths})
    assert set(rec["distinct_lengths"]) <= {128, 256}
    assert 0 <= rec["pad_share"] < 1 and rec["wall_s"] > 0
    assert rec["tokens_per_s"] <= rec["padded_tokens_per_s"]
    # nothing compiles on the CPU: every step is a steady one, and no block mask is made (eager attention)
    assert rec["compiles"] == 0 and rec["compile_s"] == 0 and rec["steady_steps"] == 6
    assert rec["steady_tokens_per_s"] > 0 and rec["attention"] == "eager" and rec["peak_mem_gib"] is None
    assert 0 < rec["startup_s"] < rec["time_to_first_step_s"]
    assert rec["first_step_s"] > 0 and rec["block_masks_cached"] == 0
    assert set(rec["real_length_quantiles"]) == {"p10", "p50", "p90", "p99"}


def test_varlen_packed_rows_on_the_cpu(tmp_path):
    """--packing: the same samples in rows of --max-length, one shape, every sample's tokens counted once."""
    out = _run_outputs(tmp_path)
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_train.py"), "--mode", "varlen", "--shapes", "tiny",
           "--steps", "12", "--ttt", "3", "--lengths-from", str(out), "--max-length", "256", "--packing"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads(res.stdout.strip().splitlines()[-1])
    lengths = draw(shard_lengths(out), 12, 0, 256)
    rows = pack_lengths(lengths, 256)
    assert rec["packing"] is True and rec["length_bucket"] is None and rec["distinct_lengths"] == [256]
    assert rec["steps"] == len(rows) < 12 and rec["samples"] == 12
    assert rec["real_tokens"] == sum(lengths) and rec["padded_tokens"] == 256 * len(rows)
    assert rec["pad_share"] == round(1 - sum(lengths) / (256 * len(rows)), 4)


def test_the_benchmark_imports_no_pydantic():
    code = ("import sys; sys.path.insert(0, 'scripts'); import bench_train; from regen_service.bench import varlen; "
            "sys.exit(int('pydantic' in sys.modules))")  # fmt: skip
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0
