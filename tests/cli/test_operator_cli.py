"""The operator's day at the command line: loud data problems, one-line errors for operational faults
(nothing written when the ledger is away), runs found by prefix and name, status in pipes. Every
command runs as the real `regen` CLI in its own process, on the real Redis."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import redis
import yaml

from regen_service.produce.producer import enqueue
from regen_service.state.ledger import Ledger
from tests.e2e.test_exactly_once import write_prompt_mix
from tests.procs import free_port, regen_cmd


def regen(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        regen_cmd(*args), env={**os.environ, **env}, capture_output=True, text=True, timeout=60
    )


def _mix_with_a_dead_source(tmp_path: Path) -> Path:
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(30)))
    bad.write_text(
        "".join(json.dumps({"question": f"question {i}"}) + "\n" for i in range(12))
    )  # no `prompt`
    mix = tmp_path / "mix.yaml"
    mix.write_text(yaml.safe_dump({
        "name": "dead-source", "target": {"model": "moonshotai/Kimi-K2.5", "api": "chat"}, "shard_size": 10,
        "sources": [{"name": "good", "path": str(good), "format": "prompt_response"},
                    {"name": "dead", "path": str(bad), "format": "prompt_response"}],
    }))  # fmt: skip
    return mix


def test_a_source_that_keeps_nothing_is_loud(settings, settings_env, tmp_path):
    mix = _mix_with_a_dead_source(tmp_path)
    strict = regen(settings_env, "enqueue", str(mix), "--strict")
    assert strict.returncode == 1
    assert "source 'dead' keeps nothing: 12 of 12 rows quarantined" in strict.stderr
    assert "prompt: missing" in strict.stderr  # the reason, not only the count
    assert not Ledger(settings).run_ids()  # --strict queued nothing

    plain = regen(settings_env, "enqueue", str(mix))
    assert plain.returncode == 0
    assert "warning: source 'dead' keeps nothing" in plain.stderr
    report = next(line for line in plain.stderr.splitlines() if line.startswith("dead "))
    assert report.split()[1:5] == ["12", "0", "0", "12"]  # read, kept, duplicate, quarantined

    status = json.loads(regen(settings_env, "status", plain.stdout.strip(), "--json").stdout)
    assert status["sources"]["dead"]["quarantined"] == 12 and status["sources"]["dead"]["kept"] == 0
    assert status["sources"]["good"]["quarantined"] == 0


def test_a_strict_enqueue_that_fails_exits_1_and_never_aborts(settings, settings_env, tmp_path):
    # It read the quarantine with Arrow's thread pool and exited at once: SIGABRT at exit 3 times in 8
    # (apache/arrow#34314) before Storage.read_table read on one thread.
    mix = _mix_with_a_dead_source(tmp_path)
    codes = [regen(settings_env, "enqueue", str(mix), "--strict").returncode for _ in range(8)]
    assert codes == [1] * 8


def test_operational_faults_are_one_line(settings, settings_env, tmp_path):
    down = {**settings_env, "REGEN_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    mix = write_prompt_mix(tmp_path, "no-redis", 10, 5)
    for args in (("status",), ("enqueue", str(mix)), ("runs",), ("resume", "x")):
        res = regen(down, *args)
        assert res.returncode == 1, args
        assert (
            res.stderr.count("\n") == 1 and "is not reachable" in res.stderr and "Traceback" not in res.stderr
        )
    assert not Path(settings.data_root_resolved).exists()  # nothing written without a ledger

    bad_url = regen({**settings_env, "REGEN_REDIS_URL": "http://127.0.0.1:6379"}, "status")
    assert bad_url.returncode == 1 and bad_url.stderr.count("\n") == 1
    assert "REGEN_REDIS_URL must start with redis://" in bad_url.stderr and "pydantic" not in bad_url.stderr

    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = regen(settings_env, "worker", "--endpoint", "http://127.0.0.1:9", "--metrics-port", str(port))
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert f"--metrics-port {port}: cannot listen" in res.stderr


def test_runs_are_found_by_prefix_name_and_near_matches(settings, settings_env, tmp_path):
    a = enqueue(settings, write_prompt_mix(tmp_path, "alpha-mix", 10, 5))
    b = enqueue(settings, write_prompt_mix(tmp_path, "beta-mix", 10, 5))
    by_prefix = json.loads(regen(settings_env, "status", a.run_id[:8], "--json").stdout)
    assert by_prefix["run_id"] == a.run_id
    by_name = json.loads(regen(settings_env, "status", "beta-mix", "--json").stdout)
    assert by_name["run_id"] == b.run_id

    miss = regen(settings_env, "status", "alpah-mix")
    assert miss.returncode == 1 and "near matches" in miss.stderr and a.run_id in miss.stderr

    # Redis loses the ledger: the runs are still listed from the data root, and resume finds them.
    r = redis.Redis.from_url(settings.redis_url)
    r.delete(*r.scan_iter(f"{settings.key_prefix}*"))
    listed = regen(settings_env, "runs").stdout
    assert a.run_id in listed and b.run_id in listed and "not in the ledger" in listed
    overview = regen(settings_env, "status").stdout
    assert f"{a.run_id}  not in the ledger" in overview
    assert regen(settings_env, "resume", "alpha").returncode == 0
    assert a.run_id in Ledger(settings).run_ids()


def test_resume_says_when_a_killed_workers_lease_frees(settings, settings_env, tmp_path):
    res = enqueue(settings, write_prompt_mix(tmp_path, "leased", 10, 10))
    Ledger(settings).acquire_lease(res.run_id, 0, "killed-worker")  # what a kill -9 leaves behind
    out = regen(settings_env, "resume", res.run_id)
    assert out.returncode == 0 and "1 held by leases" in out.stdout
    assert "frees in" in out.stderr and f"regen resume {res.run_id}` again" in out.stderr


def test_status_in_a_pipe_is_full_width(settings, settings_env, tmp_path):
    name = "a-mix-with-a-rather-long-name-to-see-whether-status-cuts-it-off"
    res = enqueue(settings, write_prompt_mix(tmp_path, name, 10, 5))
    out = regen({**settings_env, "COLUMNS": "80"}, "status").stdout
    headline = next(line for line in out.splitlines() if line.startswith(res.run_id))
    assert len(headline) > 120 and "ETA" in headline and name in headline


def test_the_demos_runs_are_found_without_its_key_prefix(settings, settings_env, tmp_path):
    from regen_service.state.find_runs import demo_settings

    demo = demo_settings(settings)  # the namespace `regen demo` enqueues under, for this data root
    res = enqueue(demo, write_prompt_mix(tmp_path, "demo-like", 10, 5))
    try:
        st = json.loads(regen(settings_env, "status", res.run_id[:10], "--json").stdout)
        assert st["run_id"] == res.run_id and st["key_prefix"] == demo.key_prefix
        assert res.run_id in regen(settings_env, "runs").stdout
    finally:
        r = redis.Redis.from_url(settings.redis_url)
        keys = list(r.scan_iter(f"{demo.key_prefix}*"))
        if keys:
            r.delete(*keys)
