"""scripts/bench_train_peers.py: the plan, the peers' layout, the processes it runs, the comparison, and
regen's side end to end on the CPU at tiny shapes (the peers' steps need a GPU and their packages)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from regen_service.bench import peers_run

ROOT = Path(__file__).resolve().parents[2]


def test_a_plan_names_known_shapes_and_lengths():
    assert peers_run.parse_plan("llama-3.1-8b:2048; kimi:2048,8192") == [
        ("llama-3.1-8b", [2048]),
        ("kimi", [2048, 8192]),
    ]
    for bad in ("", "gpt:2048", "kimi"):
        with pytest.raises(ValueError, match="--plan"):
            peers_run.parse_plan(bad)


def test_the_layout_links_the_checkouts_beside_the_peer_benchmark(tmp_path):
    (tmp_path / "SpecForge" / "specforge" / "modeling").mkdir(parents=True)
    (tmp_path / "speculators" / "src" / "speculators" / "models").mkdir(parents=True)
    bp = tmp_path / "bench_peers.py"
    bp.write_text("print('peer')\n")
    d = peers_run.layout(tmp_path / "out", bp, tmp_path / "SpecForge", tmp_path / "speculators")
    assert (d / "sf" / "specforge" / "modeling").is_dir() and (
        d / "spec" / "src" / "speculators" / "models"
    ).is_dir()
    assert (d / "spec" / "stub" / peers_run.SPECULATORS_STUB / "METADATA").is_file()
    procs = peers_run.commands([("kimi", [2048, 8192])], ROOT, d, 4, "/tmp/site")
    assert [p.name for p in procs] == ["regen-kimi", "specforge-kimi-2048", "speculators-kimi-2048",
                                       "specforge-kimi-8192", "speculators-kimi-8192"]  # fmt: skip
    assert procs[0].argv[-6:] == ["--seq", "2048,8192", "--step", "whole,draft", "--steps", "4"]
    assert procs[1].env["P3_SHAPES"] == peers_run.PEER_SHAPES["kimi"] and "flex_attention" in procs[1].argv
    assert procs[2].env["PYTHONPATH"] == "/tmp/site"
    # SpecForge's flex compile at 16K alone passed 177 s on an H200: long lengths get the longer cap
    long = peers_run.commands([("kimi", [16384])], ROOT, d, 4)
    assert [p.cap_s for p in long[1:]] == [480, 480] and {p.cap_s for p in procs[1:]} == {240}
    with pytest.raises(FileNotFoundError, match="no specforge/ package"):
        peers_run.layout(tmp_path / "o2", bp, tmp_path / "speculators", None)


def test_compare_holds_everyone_to_the_whole_step_formula():
    lines = [
        {"shapes": "kimi", "seq": 8192, "step": "whole", "step_s": 0.70, "tokens_per_s": 11703, "mfu_vs_989": 0.56,
         "peak_mem_gib": 47.0, "process_age_s": 90.0},
        {"shapes": "kimi", "seq": 8192, "step": "draft", "step_s": 0.68, "tokens_per_s": 12047, "mfu_vs_989": 0.545},
        {"shapes": "kimi", "seq": 8192, "impl": "specforge", "batch": 1, "ttt": 7, "step_s": 0.78,
         "tokens_per_s": 10490, "mfu_vs_989": 0.475, "peak_mem_gib": 50.6},
        {"shapes": "kimi", "seq": 8192, "impl": "speculators", "batch": 1, "ttt": 7, "step_s": 0.72,
         "tokens_per_s": 11411, "mfu_vs_989": 0.517},
        {"run": "x", "rc": 1},
    ]  # fmt: skip
    (row,) = peers_run.compare(lines)
    assert row["regen_whole_over_best_peer"] == round(11703 / 11411, 3)
    # the peers' own line counts the draft only; recounted with the head each multiplies, their MFU rises
    assert row["specforge"]["mfu_whole_formula"] > 0.475 and row["speculators"]["mfu_whole_formula"] > 0.517
    assert row["specforge"]["mfu_whole_formula"] - 0.475 > row["speculators"]["mfu_whole_formula"] - 0.517
    assert row["regen_whole"]["process_age_s"] == 90.0


def test_a_peer_that_times_out_is_named_and_no_best_peer_ratio_leaves_it_out():
    """run_all against real processes: the speculators stand-in outlives its cap (as speculators did at
    Kimi 16K on 2026-12-04, past the call's deadline); the row says so and the ratio is over who ran."""
    lines: list[dict] = []
    py = sys.executable
    procs = [
        peers_run.Proc("regen-kimi", [py, "-c", "print('{\"shapes\": \"kimi\", \"seq\": 8192, \"step\": "
                       "\"whole\", \"step_s\": 0.6, \"tokens_per_s\": 13800, \"mfu_vs_989\": 0.66}')"],
                       {}, 60, {"shapes": "kimi"}),
        peers_run.Proc("specforge-kimi-8192", [py, "-c", "print('{\"impl\": \"specforge\", \"batch\": 1, "
                       "\"ttt\": 7, \"step_s\": 0.79, \"tokens_per_s\": 10300, \"mfu_vs_989\": 0.46}')"],
                       {}, 60, {"shapes": "kimi", "seq": 8192, "impl": "specforge"}),
        peers_run.Proc("speculators-kimi-8192", [py, "-c", "import time; time.sleep(30)"], {}, 1,
                       {"shapes": "kimi", "seq": 8192, "impl": "speculators"}),
    ]  # fmt: skip
    peers_run.run_all(procs, 120, lines.append)
    assert any(x.get("rc") == "timeout" and x["impl"] == "speculators" for x in lines)
    (row,) = peers_run.compare(lines)
    assert row["peers_missing"] == ["speculators (rc timeout)"]
    assert "regen_whole_over_best_peer" not in row
    assert row["regen_whole_over_peers_that_ran"] == round(13800 / 10300, 3)


def test_regen_side_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "r.jsonl"
    argv = [sys.executable, str(ROOT / "scripts" / "bench_train_peers.py"), "--plan", "tiny:128", "--steps", "1",
            "--out", str(out)]  # fmt: skip
    p = subprocess.run(
        argv, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["step"] for x in lines if x.get("run") == "regen-tiny"] == ["whole", "draft"]
    (row,) = [x for x in lines if x.get("compare")]
    assert {"regen_whole", "regen_draft"} <= set(
        row
    ) and "regen_whole_over_best_peer" not in row  # no peers run


def test_a_missing_peer_benchmark_exits_2(tmp_path):
    argv = [sys.executable, str(ROOT / "scripts" / "bench_train_peers.py"), "--specforge", str(tmp_path),
            "--bench-peers", str(tmp_path / "nope.py")]  # fmt: skip
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "bench_peers.py" in p.stderr
