"""The memory fit check (issue 21, bad input: a length beyond what fits) on the CPU: the line's arithmetic,
the same decision code driven by the CPU's saved-tensor measure or an injected one (the GPU's is the
allocator's peak), and the wiring into `regen train`: a length that cannot fit is refused before any
optimizer step, naming the field to lower and the largest length that fits."""

from __future__ import annotations

import functools

import pytest
import torch

from regen_service.errors import ConfigError, LengthDoesNotFitError
from regen_service.train import loop
from regen_service.train.config import TrainConfig
from regen_service.train.dist import DistContext
from regen_service.train.memory import TRIES, fit_check, fit_line, largest_fitting, search_largest
from regen_service.train.trainer import DraftTrainer
from tests.train.test_units import tiny_config

GIB = 2**30
MIB = 2**20


def _trainer(**cfg) -> DraftTrainer:
    c = tiny_config()
    tc = TrainConfig(ttt_length=3, **cfg)
    return DraftTrainer(tc, c, torch.randn(c.vocab_size, c.hidden_size), DistContext(), total_steps=10)


def _linear(fixed: int, per_position: int):
    return lambda t: fixed + per_position * t


def test_fit_line_is_exact_on_a_line_and_least_squares_over_more_points():
    assert fit_line([(512, 10 + 512 * 3), (1024, 10 + 1024 * 3)]) == pytest.approx((10, 3))
    fixed, slope = fit_line([(0, 1.0), (1, 3.0), (2, 4.0)])
    assert (fixed, slope) == pytest.approx((7 / 6, 1.5))
    with pytest.raises(ValueError):
        fit_line([(512, 1.0), (512, 2.0)])


def test_largest_fitting_is_the_last_whole_block_under_the_budget():
    # 128 tokens cost 128 MiB: 1000 MiB of room holds 7 whole blocks
    assert largest_fitting(24 * MIB, MIB, 1024 * MIB) == 896
    assert largest_fitting(0, MIB, 1024 * MIB) == 1024  # exactly at the budget fits
    assert largest_fitting(0, MIB, 1024 * MIB, multiple=100) == 1000
    assert largest_fitting(2 * GIB, MIB, GIB) == 0  # the fixed part alone is over
    with pytest.raises(ValueError):
        largest_fitting(0, 0, GIB)


def test_search_largest_finds_the_last_fitting_block_in_few_trials():
    tried = []

    def fits(t: int) -> bool:
        tried.append(t)
        return t <= 5000

    assert search_largest(fits, 1024, 16384) == 4992 and len(tried) <= TRIES
    assert all(t % 128 == 0 for t in tried)
    tried.clear()
    assert search_largest(fits, 1024, 16384, guess=4999) == 4992 and tried[0] == 4992  # the guess first
    assert search_largest(lambda t: False, 0, 16384) == 0  # nothing fits: 0
    assert search_largest(fits, 1024, 1100) == 1024  # no block between: lo, untried


def test_the_kimi_figures_measured_on_an_h200_give_about_forty_thousand_tokens():
    # peak GiB per length at Kimi-K2.5 draft shapes, batch 1 (docs/training.md): linear, ~2.9 MiB a token
    points = [(2048, 25.9 * GIB), (4096, 31.6 * GIB), (8192, 43.2 * GIB), (16384, 66.4 * GIB)]
    fixed, per_token = fit_line(points)
    assert 19 * GIB < fixed < 21 * GIB and 2.7 * MIB < per_token < 3.0 * MIB
    largest = largest_fitting(fixed, per_token, 139 * GIB * 0.95)
    assert largest % 128 == 0 and 38_000 < largest < 42_000


def test_cpu_without_a_budget_skips_the_check():
    def never(t):
        raise AssertionError("measured on the CPU without a budget")

    assert fit_check(_trainer(), 65536, 1, measure=never) is None


@pytest.mark.parametrize("soft", [True, False])
def test_the_real_probe_leaves_parameters_optimizer_and_rng_untouched(soft):
    """The default CPU measure runs the trainer's own TTT step forward and backward, never a step."""
    tr = _trainer()
    before = {k: v.clone() for k, v in tr.draft.state_dict().items()}
    masters = [m.detach().clone() for m in tr.masters.masters]
    rng = torch.get_rng_state()
    report = fit_check(tr, 256, 2, soft=soft, budget_bytes=GIB, probe_lengths=(32, 64))
    assert report is not None and report.max_length == 256 and report.batch_size == 2
    assert report.measured_bytes is not None and report.predicted_bytes <= report.budget_bytes
    assert report.fixed_bytes > 0 and report.per_token_bytes > 0 and report.largest_length >= 256
    assert "max_length 256 x batch 2" in report.summary()
    assert all(torch.equal(before[k], v) for k, v in tr.draft.state_dict().items())
    assert all(torch.equal(a, b) for a, b in zip(masters, tr.masters.masters, strict=True))
    assert all(p.grad is None for p in tr.draft.parameters())
    assert tr.step == 0 and not tr.opt.state and torch.equal(torch.get_rng_state(), rng)
    # and a step still trains after it
    ids = torch.randint(0, 50, (2, 16))
    m = tr.train_batch(torch.randn(2, 16, 96), ids, ids, torch.ones_like(ids))
    assert torch.isfinite(m["loss"]) and tr.step == 1


def test_a_budget_too_small_is_refused_before_any_step_with_the_largest_length_that_fits():
    tr = _trainer()
    before = {k: v.clone() for k, v in tr.draft.state_dict().items()}
    measure = _linear(40 * MIB, 100 * 1024)  # 100 KiB a position: 128 positions are 12.5 MiB
    with pytest.raises(LengthDoesNotFitError) as e:
        fit_check(tr, 65536, 1, budget_bytes=512 * MIB, measure=measure)
    assert isinstance(e.value, ConfigError)
    largest = e.value.largest_length
    assert largest % 128 == 0 and 0 < largest < 65536
    msg = str(e.value)
    assert msg.startswith("data.max_length 65536 at data.batch_size 1 needs ~")
    assert f"the largest length that fits is {largest:,} tokens" in msg
    assert "lower data.max_length or data.batch_size" in msg and "hidden 32" in msg and "TTT 3" in msg
    assert tr.step == 0 and not tr.opt.state
    assert all(torch.equal(before[k], v) for k, v in tr.draft.state_dict().items())
    # the length it names passes the same check, one block more does not
    assert fit_check(tr, largest, 1, budget_bytes=512 * MIB, measure=measure).largest_length >= largest
    with pytest.raises(LengthDoesNotFitError):
        fit_check(tr, largest + 128, 1, budget_bytes=512 * MIB, measure=measure)


def test_the_message_names_the_fields_it_is_given_and_the_batch_counts():
    tr = _trainer()
    measure = _linear(40 * MIB, 4 * 100 * 1024)  # measured at batch 4: 100 KiB a token
    with pytest.raises(LengthDoesNotFitError) as e:
        fit_check(tr, 8192, 4, budget_bytes=512 * MIB, measure=measure, fields=("--seq", "--batch"))
    assert str(e.value).startswith("--seq 8192 at --batch 4 needs ~")
    assert "lower --seq or --batch" in str(e.value)
    at_batch_1 = largest_fitting(40 * MIB, 100 * 1024, 512 * MIB)
    assert 0 < e.value.largest_length <= at_batch_1 // 4 + 128


def test_a_trial_step_over_the_budget_is_refused_though_the_line_passed():
    """Super-linear growth the two short probes cannot see: the trial at max_length catches it."""
    tr = _trainer()
    measure = lambda t: 40 * MIB + 1024 * t + (t * t) // 8  # noqa: E731
    budget = 70 * MIB  # the line through 512 and 1024 says ~59 MiB at 16384; the trial measures ~88
    with pytest.raises(LengthDoesNotFitError) as e:
        fit_check(tr, 16384, 1, budget_bytes=budget, measure=measure)
    assert "as a trial step at that length measured" in str(e.value)
    largest = e.value.largest_length
    assert 0 < largest < 16384 and f"{largest:,} tokens" in str(e.value)
    assert fit_check(tr, largest, 1, budget_bytes=budget, measure=measure) is not None


def test_out_of_memory_in_the_trial_step_is_a_config_error_not_a_traceback():
    tr = _trainer()

    def measure(t: int) -> int:
        if t > 4096:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return 40 * MIB + 1024 * t

    with pytest.raises(LengthDoesNotFitError) as e:
        fit_check(tr, 16384, 1, budget_bytes=GIB, measure=measure)
    assert "a trial step at that length ran out of memory" in str(e.value)
    largest = e.value.largest_length  # found by trial steps: at most 4096 tokens fit, and 4096 does
    assert 0 < largest <= 4096 and f"{largest:,} tokens" in str(e.value)
    assert fit_check(tr, largest, 1, budget_bytes=GIB, measure=measure) is not None
    with pytest.raises(LengthDoesNotFitError) as e:  # even a probe: no line, still a message
        fit_check(tr, 16384, 1, budget_bytes=GIB, measure=lambda t: measure(8 * t))
    assert "a trial step at only 1024 tokens ran out of memory" in str(e.value)
    assert e.value.largest_length == 0 and tr.step == 0


def test_regen_train_runs_the_check_before_the_first_batch(settings, tmp_path, monkeypatch):
    """loop.py calls it with data.max_length and data.batch_size where the trainer is built; a refusal
    leaves the trainer before any shard is read (the CPU skips it: here it is given a budget)."""
    from regen_service.train.fixtures import make_tiny_target

    target = make_tiny_target(tmp_path / "target", layers=4, hidden=32, heads=4, kv_heads=2)
    calls = []

    def check(trainer, max_length, batch_size, **kw):
        calls.append((max_length, batch_size, kw))
        return fit_check(trainer, max_length, batch_size, budget_bytes=MIB, probe_lengths=(16, 32), **kw)

    monkeypatch.setattr(loop, "fit_check", check)
    cfg = TrainConfig(draft_vocab_size=64, max_length=128, batch_size=2, total_steps=5, ttt_length=2)
    run = functools.partial(loop.train_from_run, settings, "run-x", str(target), device="cpu")
    with pytest.raises(LengthDoesNotFitError) as e:
        run(str(tmp_path / "out"), cfg)
    assert str(e.value).startswith("data.max_length 128 at data.batch_size 2 needs ~")
    assert calls == [(128, 2, {"soft": True})]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    calls.clear()
    cfg = cfg.model_copy(update={"fit_check": False})
    assert run(str(tmp_path / "out2"), cfg)["reason"] == "no shards" and calls == []
