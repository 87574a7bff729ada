"""scripts/bench_attention.py on the CPU: flash_ttt's reference kernels, a whole row and a packed row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from regen_service.bench.attention import _segments

ROOT = Path(__file__).resolve().parents[2]


def test_the_attention_micro_runs_on_the_cpu_and_names_what_it_cannot():
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_attention.py"), "--seq", "1024", "--backends", "reference",
           "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--docs", "1024", "--repeats", "2"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    rec = json.loads(res.stdout.strip().splitlines()[-1])
    assert rec["T"] == 1024 and rec["device"] == "cpu" and rec["kv_heads"] == 2
    assert rec["reference_fwd_ms"] > 0 and rec["reference_bwd_ms"] > 0 and rec["reference_docs_new_ms"] > 0
    assert sum(rec["doc_lengths"]) <= 1024 and len(rec["doc_lengths"]) >= 2
    bad = subprocess.run([*cmd[:5], "cudnn"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert bad.returncode == 2 and "only --backends reference runs on the CPU" in bad.stderr


def test_new_document_lengths_move_every_inner_boundary():
    assert _segments([5, 3, 4], 0, 16) == ((0, 0, 5), (0, 5, 8), (0, 8, 12), (0, 12, 16))
    assert _segments([5, 3, 4], 2, 16) == ((0, 0, 7), (0, 7, 12), (0, 12, 16))
