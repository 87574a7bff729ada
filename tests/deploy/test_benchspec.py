"""bench-spec: parsing of SGLang's speculative metrics, and end to end against `regen sim`."""

from __future__ import annotations

import json
import subprocess

import pytest

from regen_service.deploy.benchspec import (
    BenchReport,
    RunResult,
    diagnose,
    load_prompts,
    request_accept_length,
    server_accept_length,
)
from regen_service.errors import ConfigError
from tests.procs import regen_cmd, sim_server

SIM = (
    "--decode-tok-s",
    "200",
    "--answer-len-dist",
    "fixed",
    "--answer-len-mean",
    "60",
    "--log-level",
    "WARNING",
)


def test_request_accept_length_prefers_verify_count():
    assert (
        request_accept_length({"completion_tokens": 60, "spec_verify_ct": 20, "spec_accept_length": 9}) == 3.0
    )
    assert request_accept_length({"completion_tokens": 10, "spec_accept_length": 2.5}) == 2.5
    assert request_accept_length({"completion_tokens": 10}) is None


def test_server_accept_length_reads_internal_states_only():
    assert server_accept_length({"avg_spec_accept_length": 9.0}) is None
    info = {"internal_states": [{"avg_spec_accept_length": 3.0}, {"avg_spec_accept_length": 2.0}, {"x": 1}]}
    assert server_accept_length(info) == 2.5


def test_load_prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n\n{"messages": [{"role": "user", "content": "b"}]}\n')
    assert [p.prompt for p in load_prompts(f)] == ["a", None]
    f.write_text('{"prompt": "a", "messages": []}\n')
    with pytest.raises(ConfigError, match="exactly one"):
        load_prompts(f)


def _run(accept: float | None) -> RunResult:
    return RunResult(endpoint="x", concurrency=1, requests=1, failed=0, output_tokens=1, wall_s=1, tok_s=1,
                     accept_length=accept, server_accept_length=accept)  # fmt: skip


def test_diagnosis_order():
    report = BenchReport(spec=[_run(1.02)])
    diagnose(report)
    assert report.collapsed
    assert "EAGLE3" in report.diagnosis[0] and "layers.0" in report.diagnosis[1]
    assert "d2t" in report.diagnosis[2] and "auxiliary layers" in report.diagnosis[3]
    healthy = BenchReport(spec=[_run(2.8)])
    diagnose(healthy)
    assert not healthy.collapsed and healthy.accept_length == 2.8


@pytest.fixture
def prompts(tmp_path):
    f = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"question {i}: why is the sky blue?"} for i in range(6)]
    rows.append({"messages": [{"role": "user", "content": "hello"}]})
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return f


def test_bench_reports_accept_length_and_speedup(prompts):
    with sim_server(*SIM, "--spec-accept-length", "3.0") as spec, sim_server(*SIM) as base:
        r = subprocess.run(
            regen_cmd("bench-spec", "--endpoint", spec, "--baseline", base, "--prompts", str(prompts),
                      "--concurrency", "1", "--concurrency", "4", "--max-new-tokens", "60", "--json"),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert r.returncode == 0, r.stderr + r.stdout
    data = json.loads(r.stdout)
    assert data["collapsed"] is False
    assert data["accept_length"] == pytest.approx(3.0, abs=0.2)
    assert [run["concurrency"] for run in data["spec"]] == [1, 4]
    for run in data["spec"]:
        assert run["failed"] == 0 and run["output_tokens"] > 0
        assert run["accept_length"] == pytest.approx(3.0, abs=0.2)
        assert all(a == pytest.approx(3.0, abs=0.3) for a in run["per_request_accept"])
    # The sim decodes 0.8 * L = 2.4x faster with speculation.
    for c in ("1", "4"):
        assert 1.6 < data["speedup"][c] < 3.2, data["speedup"]


def test_bench_fails_with_diagnosis_when_accept_length_is_one(prompts):
    with sim_server(*SIM, "--spec-accept-length", "1.0") as spec:
        r = subprocess.run(
            regen_cmd("bench-spec", "--endpoint", spec, "--prompts", str(prompts), "--max-new-tokens", "30"),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert r.returncode == 1, r.stdout + r.stderr
    assert "SPECULATION IS NOT WORKING" in r.stdout
    lines = r.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.strip().startswith("1."))
    assert "--speculative-algorithm EAGLE" in lines[first] and "layers.0" in lines[first + 1]
    assert "d2t" in lines[first + 2] and "auxiliary layers" in lines[first + 3]


def test_bench_fails_when_endpoint_has_no_speculation(prompts):
    with sim_server(*SIM) as base:
        r = subprocess.run(
            regen_cmd("bench-spec", "--endpoint", base, "--prompts", str(prompts), "--max-new-tokens", "20"),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert r.returncode == 1 and "no speculative metrics" in r.stdout
