"""The shard-intake rule on kombu's real QoS object (what Celery's consumer applies): another shard
whenever the prompts in hand cannot fill the in-flight budget, never more than the memory bounds."""

from __future__ import annotations

from kombu.common import QoS

from regen_service.work.intake import Intake


def _qos(initial: int) -> tuple[QoS, list[int]]:
    applied: list[int] = []
    qos = QoS(lambda prefetch_count: applied.append(prefetch_count), initial)
    qos.update()
    return qos, applied


def test_takes_the_next_shard_when_the_prompts_in_hand_run_low():
    intake = Intake(max_shards=64, max_prompts=10_000, inflight_target=lambda: 32)
    qos, applied = _qos(64)  # Celery starts at concurrency x prefetch multiplier
    intake.attach(qos)
    qos.update()
    assert applied[-1] == 1  # nothing in hand: one shard at a time until the first arrives
    intake.shard_started(64)
    assert intake.wanted() == 1  # 64 prompts cover twice the budget of 32
    intake.prompt_answered()
    qos.update()
    assert applied[-1] == 2  # 63 left: fetch the next shard before the slots run dry
    intake.shard_started(64)
    intake.shard_finished(0)  # the first shard is done (its last 63 answered meanwhile, say)
    assert intake.num_shards == 1


def test_small_shards_are_taken_until_the_budget_is_covered_and_bounds_hold():
    intake = Intake(max_shards=8, max_prompts=10_000, inflight_target=lambda: 300)
    qos, applied = _qos(8)
    intake.attach(qos)
    for _ in range(7):
        intake.shard_started(16)
    qos.update()
    assert applied[-1] == 8  # 7 shards of 16 = 112 prompts, still hungry... but max_shards caps it
    big = Intake(max_shards=64, max_prompts=100, inflight_target=lambda: 300)
    big.shard_started(120)
    assert not big.hungry()  # max_prompts bounds memory whatever the budget
