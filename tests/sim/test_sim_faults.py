"""The simulator's faults, outages, capacity model and speculative mode, over real HTTP."""

from __future__ import annotations

import asyncio
import itertools
import time

import httpx
import pytest

from tests.procs import sim_server
from tests.sim.test_sim import sse, user


def set_config(url: str, **patch) -> dict:
    r = httpx.post(f"{url}/sim/config", json=patch)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def faulty():
    args = (
        "--decode-tok-s",
        "200",
        "--tick-s",
        "0.005",
        "--answer-len-dist",
        "fixed",
        "--answer-len-mean",
        "30",
    )
    with sim_server(*args, "--think-prob", "0", "--fault-503-rate", "1.0") as url:
        yield url


def test_503_rate_in_both_shapes(faulty):
    r = httpx.post(f"{faulty}/generate", json={"text": "x", "stream": True})
    assert r.status_code == 503 and r.json() == {"error": {"message": "The request queue is full."}}
    r = httpx.post(f"{faulty}/v1/chat/completions", json={"messages": user("x"), "stream": True})
    assert r.status_code == 503
    assert r.json() | {"type": None} == {
        "object": "error",
        "message": "The request queue is full.",
        "type": None,
        "param": None,
        "code": 503,
    }
    assert httpx.get(f"{faulty}/sim/stats").json()["num_503"] == 2


def test_disconnect_stall_error_event_abort(faulty):
    set_config(faulty, fault_503_rate=0.0, fault_disconnect_rate=1.0)
    events = []
    stream = httpx.stream("POST", f"{faulty}/generate", json={"text": "x", "stream": True})
    with pytest.raises(httpx.HTTPError), stream as r:  # the chunked body ends without its terminator
        for line in r.iter_lines():
            events.append(line)
    assert "data: [DONE]" not in events and any(e.startswith("data: {") for e in events)
    with pytest.raises(httpx.HTTPError):
        httpx.post(f"{faulty}/v1/chat/completions", json={"messages": user("x")})

    set_config(faulty, fault_disconnect_rate=0.0, fault_stall_rate=1.0, stall_s=1.0)
    t0 = time.monotonic()
    times = []
    with httpx.stream("POST", f"{faulty}/generate", json={"text": "y", "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                times.append(time.monotonic())
    assert times[-1] - t0 >= 1.0
    assert max(b - a for a, b in itertools.pairwise(times)) >= 0.9, "one silent gap of stall_s"

    set_config(faulty, fault_stall_rate=0.0, fault_error_event_rate=1.0)
    events = sse(f"{faulty}/generate", {"text": "z", "stream": True})
    assert events[-2] == {"error": {"message": events[-2]["error"]["message"], "code": 503}}
    assert events[-1] == "[DONE]"
    chat_events = sse(f"{faulty}/v1/chat/completions", {"messages": user("z"), "stream": True})
    assert chat_events[-2]["error"]["code"] == 503 and chat_events[-1] == "[DONE]"

    set_config(faulty, fault_error_event_rate=0.0, fault_abort_rate=1.0)
    out = httpx.post(f"{faulty}/generate", json={"text": "w"}).json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["finish_reason"]["status_code"] == 503
    assert out["meta_info"]["completion_tokens"] < 30

    set_config(faulty, fault_abort_rate=0.0)
    clean = httpx.post(f"{faulty}/generate", json={"text": "w"}).json()
    assert clean["output_ids"][: len(out["output_ids"])] == out["output_ids"], (
        "faults never change the answer"
    )
    stats = httpx.get(f"{faulty}/sim/stats").json()
    assert stats["num_disconnects_injected"] == 2 and stats["num_stalls_injected"] == 1
    assert stats["num_error_events_injected"] == 2 and stats["num_aborts_injected"] == 1

    bad = httpx.post(f"{faulty}/sim/config", json={"seed": 5})
    assert bad.status_code == 400
    assert httpx.post(f"{faulty}/sim/config", json={"fault_503_rate": 2}).status_code == 400


def test_outage_then_recovery():
    with sim_server("--decode-tok-s", "20", "--answer-len-dist", "fixed", "--answer-len-mean", "200") as url:
        with httpx.Client(timeout=10) as client:
            assert client.get(f"{url}/health").status_code == 200  # a keep-alive connection
            with httpx.stream("POST", f"{url}/generate", json={"text": "long", "stream": True}) as r:
                assert httpx.post(f"{url}/sim/outage", json={"duration_s": 1.5}).json() == {"outage_s": 1.5}
                with pytest.raises(httpx.HTTPError):
                    for _ in r.iter_lines():
                        pass
            with pytest.raises(httpx.HTTPError):
                client.get(f"{url}/health")
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health")
        deadline = time.monotonic() + 10
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the server came back"
                time.sleep(0.1)
        assert httpx.get(f"{url}/health_generate").status_code == 200
        assert httpx.get(f"{url}/sim/stats").json()["running"] == 0


async def _concurrent(url: str, n: int, body: dict) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=n)) as client:
        return await asyncio.gather(
            *(client.post(f"{url}/generate", json=body | {"text": f"p{i}"}) for i in range(n))
        )


def test_capacity_model_queueing_and_queue_full():
    args = (
        "--max-running-requests",
        "4",
        "--max-queued-requests",
        "4",
        "--decode-tok-s",
        "20",
        "--batch-slowdown",
        "0",
    )
    with sim_server(
        *args, "--answer-len-dist", "fixed", "--answer-len-mean", "10", "--think-prob", "0"
    ) as url:
        info = httpx.get(f"{url}/get_server_info").json()
        assert info["sim"]["capacity_tok_s"] == pytest.approx(80.0)
        httpx.post(f"{url}/sim/stats/reset")
        t0 = time.monotonic()
        responses = asyncio.run(_concurrent(url, 8, {}))
        elapsed = time.monotonic() - t0
        assert [r.status_code for r in responses] == [200] * 8
        assert 0.9 <= elapsed <= 2.5, "two waves of 10 tokens at 20 tok/s"
        stats = httpx.get(f"{url}/sim/stats").json()
        assert stats["peak_running"] == 4 and stats["peak_queued"] == 4
        assert stats["completed"] == 8 and stats["tokens_generated"] == 80
        assert stats["mean_running"] > 3.0 and stats["capacity_tok_s"] == pytest.approx(80.0)
        lat = sorted(r.json()["meta_info"]["e2e_latency"] for r in responses)
        assert lat[3] < 0.8 < lat[4], "the second four waited in the queue"

        responses = asyncio.run(_concurrent(url, 11, {}))
        codes = sorted(r.status_code for r in responses)
        assert codes == [200] * 8 + [503] * 3
        reset = httpx.post(f"{url}/sim/stats/reset").json()
        assert reset["requests_total"] == 0 and reset["num_503"] == 0


def test_speculative_mode_and_instant_answers():
    args = (
        "--decode-tok-s",
        "0",
        "--spec-accept-length",
        "3",
        "--answer-len-dist",
        "fixed",
        "--answer-len-mean",
        "10",
    )
    with sim_server(*args, "--think-prob", "0") as url:
        before = httpx.get(f"{url}/server_info").json()
        assert "avg_spec_accept_length" not in before["internal_states"][0]
        out = httpx.post(f"{url}/generate", json={"text": "spec"}).json()
        meta = out["meta_info"]
        assert meta["spec_verify_ct"] == 4 and meta["spec_accept_length"] == pytest.approx(10 / 4)
        info = httpx.get(f"{url}/server_info").json()
        assert info["internal_states"][0]["avg_spec_accept_length"] == pytest.approx(2.5)
        assert info["speculative_algorithm"] == "EAGLE3"
        assert "sglang:spec_accept_length{" in httpx.get(f"{url}/metrics").text
        t0 = time.monotonic()
        responses = asyncio.run(_concurrent(url, 200, {}))
        assert all(r.status_code == 200 for r in responses)
        assert time.monotonic() - t0 < 5
