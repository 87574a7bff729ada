"""scripts/bench_train.py's draft mode on the CPU at tiny shapes, and the FLOP counts it reports.

The GPU figures come from a device call; here the script runs end to end as it does there (a
subprocess, `--step whole` and `--step draft`) and its JSON line is checked: the step it says it
timed, the FLOP split (the target head counted in the whole step only) and the MFU from the total.
The peers' lines are recomputed under the same formula, and the counting module imports without torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from regen_service.bench.train_flops import (
    PEAK_BF16,
    draft_shapes,
    model_flops,
    peer_step_figures,
    step_figures,
    target_head_flops,
)

ROOT = Path(__file__).resolve().parents[2]
KIMI_PEERS = "7168,64,64,18432,163840,32000"  # run_kimi.sh's P3_SHAPES


def _bench(step: str) -> subprocess.Popen:
    argv = [sys.executable, "scripts/bench_train.py", "--mode", "draft", "--shapes", "tiny", "--seq", "256"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # the two share the cores
    return subprocess.Popen([*argv, "--steps", "2", "--step", step], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def test_the_draft_bench_runs_on_the_cpu_and_splits_its_flops():
    runs = {step: _bench(step) for step in ("whole", "draft")}
    lines = {}
    for step, proc in runs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        lines[step] = json.loads(out.strip().splitlines()[-1])
    c, keys = draft_shapes(256, 4, 2, 512, 4096, 1024), ("draft", "target_head")
    for step, line in lines.items():
        assert line["mode"] == "draft" and line["step"] == step and line["shapes"] == "tiny"
        assert line["seq"] == 256 and line["step_s"] > 0 and line["peak_mem_gib"] is None
        parts = [line[f"{k}_tflop_per_step"] for k in keys]
        assert line["model_tflop_per_step"] == pytest.approx(sum(parts), rel=1e-4)
        assert line["draft_tflop_per_step"] == pytest.approx(model_flops(c, 256, 7) / 1e12, rel=1e-4)
        total = line["model_tflop_per_step"] * 1e12
        assert line["mfu_vs_989"] == round(total / line["step_s"] / PEAK_BF16, 4)
    assert lines["whole"]["target_head_tflop_per_step"] == pytest.approx(
        2 * 256 * 256 * 4096 / 1e12, rel=1e-4
    )
    assert lines["draft"]["target_head_tflop_per_step"] == 0


def test_one_process_measures_every_length_and_step_asked_in_order():
    argv = [sys.executable, "scripts/bench_train.py", "--mode", "draft", "--shapes", "tiny", "--seq", "128,256",
            "--step", "whole,draft", "--steps", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(argv, cwd=ROOT, env=env, text=True, capture_output=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert [(x["seq"], x["step"]) for x in lines] == [
        (128, "whole"),
        (128, "draft"),
        (256, "whole"),
        (256, "draft"),
    ]
    ages = [x["process_age_s"] for x in lines]
    assert all(a > 0 for a in ages) and ages == sorted(ages)  # each first step ends later in the one process
    assert all(x["first_step_s"] > 0 and x["step_s"] > 0 for x in lines)


def test_a_bad_step_name_is_refused_with_the_allowed_ones():
    argv = [sys.executable, "scripts/bench_train.py", "--mode", "draft", "--step", "whole,fast"]
    p = subprocess.run(
        argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True, capture_output=True
    )
    assert p.returncode == 2 and "allowed whole, draft" in p.stderr


def test_step_figures_add_the_head_to_the_draft_and_take_mfu_from_the_total():
    c = draft_shapes(4096, 32, 8, 14336, 128256, 32000)
    fig = step_figures(c, 2048, 7, 2, 0.5)
    draft, head = 2 * model_flops(c, 2048, 7), 2 * target_head_flops(c, 2048)
    assert head == 2 * 2 * 2048 * 4096 * 128256
    assert fig["model_tflop_per_step"] == pytest.approx((draft + head) / 1e12, rel=1e-4)
    assert fig["mfu_vs_989"] == round((draft + head) / 0.5 / PEAK_BF16, 4)
    alone = step_figures(c, 2048, 7, 2, 0.5, whole=False)
    assert alone["target_head_tflop_per_step"] == 0 and alone["mfu_vs_989"] < fig["mfu_vs_989"]


def test_peer_lines_are_recounted_with_the_head_each_one_multiplies():
    # lines of docs/bench/train-peers-kimi.jsonl: bench_peers.py counted the draft alone (87.92 TFLOP)
    sf = {"impl": "specforge", "batch": 1, "seq": 2048, "ttt": 7, "step_s": 0.2338, "mfu_vs_989": 0.3802}
    sp = {"impl": "speculators", "batch": 1, "seq": 2048, "ttt": 7, "step_s": 0.217, "mfu_vs_989": 0.4097}
    f_sf, f_sp = peer_step_figures(sf, KIMI_PEERS), peer_step_figures(sp, KIMI_PEERS)
    assert f_sf["draft_tflop_per_step"] == f_sp["draft_tflop_per_step"] == pytest.approx(87.92, abs=0.01)
    assert f_sf["target_head_tflop_per_step"] == pytest.approx(2 * 2048 * 7168 * 163840 / 1e12, rel=1e-4)
    assert f_sp["target_head_tflop_per_step"] == pytest.approx(2 * 2048 * 7168 * 32000 / 1e12, rel=1e-4)
    assert f_sf["mfu_vs_989"] > sf["mfu_vs_989"] and f_sp["mfu_vs_989"] > sp["mfu_vs_989"]
    # speculators' line says its lm_head is frozen: no weight gradient for it, 7 x 2 T H N FLOPs fewer
    frozen = peer_step_figures({**sp, "lm_head_trained": False}, KIMI_PEERS)
    head_dw = 7 * 2 * 2048 * 7168 * 32000 / 1e12
    assert frozen["draft_tflop_per_step"] == pytest.approx(87.92 - head_dw, abs=0.01)
    assert frozen["mfu_vs_989"] < f_sp["mfu_vs_989"]
    llama = peer_step_figures(sf)  # the default shapes: Llama-3.1-8B's
    with pytest.raises(ValueError, match="not a peer's line"):
        peer_step_figures({**sf, "impl": "regen"})
    assert llama["target_head_tflop_per_step"] == pytest.approx(2 * 2048 * 4096 * 128256 / 1e12, rel=1e-4)


def test_the_flop_counts_import_without_torch():
    code = "import sys, regen_service.bench.train_flops; sys.exit('torch' in sys.modules)"
    subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True
    )
