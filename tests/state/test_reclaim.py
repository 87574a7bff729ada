"""A dead worker's shards come back on their own (state/reclaim.py's sweep), with exactly once kept.

Real processes: two `regen worker`s on the simulator, one SIGKILLed while it holds shards (running and
reserved); the visibility timeout is an hour, so only the sweep can give them back. Then kombu's own
restore of the dead worker's unacked messages (what the visibility timeout does an hour later) is run,
and must change nothing.
"""

from __future__ import annotations

import os
import signal
import time

import redis

from regen_service.cli.status_view import plain_lines
from regen_service.produce.producer import enqueue
from regen_service.state.ledger import Ledger, owner_node
from regen_service.state.queue import make_celery
from regen_service.state.reclaim import sweep_interval_s
from regen_service.state.status import run_status
from tests.e2e.test_exactly_once import output_rows, sim_stats, write_prompt_mix
from tests.procs import regen_cmd, settings_env_of, sim_server, spawn, stop, wait_progress, wait_run_done


def _held_by(ledger: Ledger, run_id: str, node: str) -> set[int]:
    states = ledger.shard_states(run_id)
    return {sid for sid, (holder, _) in ledger.leases(run_id, states).items() if owner_node(holder) == node}


def test_dead_workers_shards_come_back_without_resume(settings, tmp_path):
    settings = settings.model_copy(update={"lease_ttl_s": 4.0, "visibility_timeout_s": 3600})
    env = settings_env_of(settings)
    res = enqueue(settings, write_prompt_mix(tmp_path, "dead-host", 60, 6))
    ledger = Ledger(settings)
    app = make_celery(settings)
    sim = ("--decode-tok-s", "20", "--answer-len-mean", "30", "--max-running-requests", "16")
    with sim_server(*sim) as url:
        wargs = ("--endpoint", url, "--max-inflight-per-endpoint", "4")
        a = spawn(regen_cmd("worker", *wargs, "--hostname", "a@dead"), env=env, log=tmp_path / "a.log")
        b = spawn(regen_cmd("worker", *wargs, "--hostname", "b@live"), env=env, log=tmp_path / "b.log")
        try:
            # Kill A while it holds a shard it has made progress on, and whatever it reserved beside it.
            def a_busy():
                held = _held_by(ledger, res.run_id, "a@dead")
                prog = ledger.run_counters(res.run_id).prompts_done
                return bool(held) and prog > 0, (sorted(held), prog)

            wait_progress(a_busy, what="worker a to hold a shard", stall_s=60, procs=(a, b))
            reserved = app.control.inspect(destination=["a@dead"], timeout=2).reserved() or {}
            held = _held_by(ledger, res.run_id, "a@dead")
            in_hand = held | {r["args"][1] for r in reserved.get("a@dead", [])}
            os.killpg(a.pid, signal.SIGKILL)
            a.wait()
            t_kill = time.monotonic()

            # Meanwhile status names the dead holder (its lease still running, or run out).
            seen_dead: dict = {}

            def back_in_work():
                seen_dead.update(run_status(ledger, res.run_id)["dead_holder_shards"])
                states = ledger.shard_states(res.run_id)
                leases = ledger.leases(res.run_id, in_hand)
                back = {s for s in in_hand
                        if states[s] == "done" or (s in leases and owner_node(leases[s][0]) == "b@live")}  # fmt: skip
                return back == in_hand, sorted(back)

            wait_progress(back_in_work, what="a's shards back in work", stall_s=90, procs=(b,))
            back_s = time.monotonic() - t_kill
            assert set(seen_dead) & held, seen_dead
            assert all("dead holder a@dead" in why or "holder died" in why for why in seen_dead.values())
            lines = plain_lines([{**run_status(ledger, res.run_id), "dead_holder_shards": seen_dead}])
            assert any("holder" in line for line in lines)
            st = wait_run_done(settings, res.run_id, procs=(b,), timeout_s=90)
            # No operator action and no visibility timeout: the sweep did it, within TTL + a minute.
            assert back_s < settings.lease_ttl_s + 60
            print(f"dead host: {len(in_hand)} shards ({len(held)} running) back in work {back_s:.1f}s after "
                  f"the kill (lease TTL {settings.lease_ttl_s}s, sweep every {sweep_interval_s(settings)}s)")  # fmt: skip
            r = redis.Redis.from_url(settings.redis_url)
            unacked = f"{settings.key_prefix}:celery:unacked"
            assert r.hlen(unacked) >= 1  # a's messages: kombu would give them back only after an hour

            # What the visibility timeout does later, done now by kombu itself: harmless.
            late = make_celery(settings.model_copy(update={"visibility_timeout_s": 10}))
            wait_progress(lambda: (time.monotonic() - t_kill > 11, None), what="a's messages to age",
                          stall_s=30)  # fmt: skip
            with late.connection_for_write() as conn:
                conn.default_channel.qos.restore_visible(num=100)
            wait_progress(lambda: (r.hlen(unacked) == 0 and r.llen(f"{settings.key_prefix}:celery:"
                          f"{settings.queue_name}") == 0, r.hlen(unacked)), what="redelivered copies acked",
                          stall_s=60, procs=(b,))  # fmt: skip
            stats = sim_stats(url)
        finally:
            stop(a)
            stop(b)
    rows = output_rows(settings, res.run_id)
    assert len(rows) == len({x["prompt_id"] for x in rows}) == 60 == st["prompts_done"]
    assert ledger.run_counters(res.run_id).prompts_done == 60
    # Only what was in flight at the kill was asked twice.
    assert 60 <= stats["requests_total"] <= 60 + 4 * 2
