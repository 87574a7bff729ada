"""scripts/bench_quality.py's refusals, as a user meets them: a missing SpecForge checkout, a target that
does not converge, and more data asked than the held-out packages give each stop with exit status 2 and
a message that says what to change, before a table of meaningless numbers could be printed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from regen_service.bench.matrix import Bench
from regen_service.errors import ConfigError
from regen_service.train.small_target import TargetRecipe, build_target

ROOT = Path(__file__).resolve().parents[2]
SRC = '''"""A module that adds numbers and keeps a running total for the caller."""
import math


def add(a, b):
    """Return the sum of a and b."""
    total = a + b
    return total
'''


def test_a_missing_specforge_checkout_exits_2_before_any_work(tmp_path):
    work = tmp_path / "work"
    p = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_quality.py"), "--work", str(work), "--specforge", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr[-2000:]
    assert "SpecForge checkout not found" in p.stderr and "--specforge" in p.stderr
    assert p.stdout == "" and not work.exists()  # nothing measured, nothing written


def test_a_target_above_the_perplexity_bound_is_refused_with_its_report(tmp_path):
    for pkg in ("alpha", "beta", "held"):
        (tmp_path / "root" / pkg).mkdir(parents=True)
        (tmp_path / "root" / pkg / "m.py").write_text(SRC * 40)
    r = TargetRecipe(vocab_size=300, hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64, seq_len=32, batch=4,
                     steps=3, warmup=1, tokenizer_sample_bytes=10_000, max_perplexity=1.5, eval_tokens=2_000)  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"did not converge: held-out perplexity .* > bound 1.5 after 3 steps"
    ):
        build_target([tmp_path / "root"], {"held"}, tmp_path / "out", r, device="cpu")


def test_sizes_beyond_the_prompts_there_are_name_the_count_and_the_fix():
    bench = Bench.__new__(Bench)
    bench.common = [f"p{i}" for i in range(120)]
    with pytest.raises(ConfigError, match=r"only 120 prompts to train on, fewer than the smallest size 500"):
        bench.sizes([500, 2000])
    assert bench.sizes([100, 2000, 32000]) == [100, 120]  # the largest is what there is
