"""Benchmark the endpoint client against simulators of known capacity; prints one JSON object.

Two scenarios, each on fresh simulators: fault-free, then 10% 503s plus one of the endpoints down for
`--outage-s` seconds (`POST /sim/outage`) early in the run. Reported per scenario:
  tok_s_over_capacity  achieved output tok/s / sum of the sims' capacity_tok_s   (target >= 0.95 / 0.80)
  inflight_over_target mean in-flight / in-flight target, sampled every 50 ms
`--through direct` drives EndpointPool + Regenerator in this process the way the worker does (keep
`inflight_target` requests outstanding); `--through worker` runs `regen enqueue` and one
`regen worker` process instead and reads the same figures from the simulators' /sim/stats
(in-flight = running + queued at the servers).

    python scripts/bench_client.py --prompts 5000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from regen_service.work.client.config import PoolConfig
from regen_service.work.client.pool import EndpointPool
from regen_service.work.regenerate import Regenerator
from schemas.conversation import Conversation, Message, PromptRecord
from schemas.mix import MixSpec
from schemas.rows import OutputRow

MODEL = "moonshotai/Kimi-K2.5"
REGEN = [sys.executable, "-c", "from regen_service.cli import main; main()"]


def sims(n: int, args: argparse.Namespace, extra: list[str]):
    """n simulators of the same capacity (seeds 0..n-1), with `extra` simulator flags (faults)."""
    from regen_service.localproc import simulators

    return simulators([
        ["--seed", str(i), "--decode-tok-s", str(args.decode_tok_s), "--max-running-requests", str(args.max_running),
         "--answer-len-mean", str(args.answer_len_mean), "--answer-len-max", str(args.answer_len_max),
         "--tick-s", str(args.tick_s), "--log-level", "WARNING", *extra]
        for i in range(n)
    ])  # fmt: skip


def capacity(urls: list[str]) -> float:
    return sum(httpx.get(f"{u}/get_server_info").json()["sim"]["capacity_tok_s"] for u in urls)


def records(n: int) -> list[PromptRecord]:
    return [
        PromptRecord(prompt_id=f"b{i:06d}", source="bench", row_index=i,
                     conversation=Conversation(messages=(Message(role="user", content=f"bench prompt {i}"),)))
        for i in range(n)
    ]  # fmt: skip


def mix() -> MixSpec:
    return MixSpec.model_validate({"name": "bench", "target": {"model": MODEL}, "sampling": {"max_new_tokens": 4096},
                                   "sources": [{"name": "bench", "path": "bench.jsonl", "format": "messages"}]})  # fmt: skip


async def inject_faults(urls: list[str], args: argparse.Namespace) -> None:
    async with httpx.AsyncClient() as c:
        for u in urls:
            await c.post(f"{u}/sim/config", json={"fault_503_rate": args.fault_503_rate})
        await asyncio.sleep(args.outage_after_s)
        await c.post(f"{urls[0]}/sim/outage", json={"duration_s": args.outage_s})


async def drive_direct(urls: list[str], args: argparse.Namespace, faults: bool) -> dict:
    cfg = PoolConfig(endpoints=urls, backoff_initial_s=0.2, backoff_max_s=5.0, backoff_jitter_s=0.2,
                     breaker_probe_max_s=2.0)  # fmt: skip
    async with EndpointPool(cfg, MODEL) as pool:
        regen = Regenerator(pool, mix())
        todo = records(args.prompts)
        samples: list[float] = []
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                samples.append(pool.inflight / pool.inflight_target)
                await asyncio.sleep(0.05)

        rows: list[OutputRow] = []

        async def lanes() -> None:
            # keep inflight_target requests outstanding; the target shrinks while an endpoint is ejected
            tasks: set[asyncio.Task] = set()
            while todo or tasks:
                while todo and len(tasks) < pool.inflight_target:
                    tasks.add(asyncio.create_task(lane_once()))
                _, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)

        async def lane_once() -> None:
            if todo:
                rows.append(await regen.regenerate(todo.pop()))

        sampler = asyncio.create_task(sample())
        injector = asyncio.create_task(inject_faults(urls, args)) if faults else None
        t0 = time.monotonic()
        await lanes()
        wall = time.monotonic() - t0
        done.set()
        await sampler
        if injector:
            injector.cancel()
        tokens = sum(r.completion_tokens or 0 for r in rows)
        errors = [r for r in rows if r.error]
        return {"rows": len(rows), "errors": len(errors), "wall_s": round(wall, 2), "output_tokens": tokens,
                "tok_s": round(tokens / wall, 1), "inflight_over_target": round(sum(samples) / len(samples), 4),
                "attempts_mean": round(sum(r.attempts for r in rows) / len(rows), 3),
                "endpoints": pool.snapshot()["endpoints"]}  # fmt: skip


def drive_worker(urls: list[str], args: argparse.Namespace, faults: bool) -> dict:
    """One real `regen worker` process over Redis/Celery. Output tokens are those of the rows the run kept
    (read back from its Parquet shards), not the simulators' counters, which include answers lost in flight."""
    from regen_service.settings import Settings
    from regen_service.state.ledger import Ledger
    from regen_service.state.status import run_status

    work = Path(tempfile.mkdtemp(prefix="regen-bench-"))
    with open(work / "bench.jsonl", "w") as f:
        for r in records(args.prompts):
            f.write(
                json.dumps({"messages": [m.model_dump(exclude_none=True) for m in r.conversation.messages]})
                + "\n"
            )
    m = mix().model_dump(exclude={"base_dir"})
    (work / "mix.yaml").write_text(json.dumps(m))
    env = {**os.environ, "REGEN_DATA_ROOT": str(work / "data"), "REGEN_KEY_PREFIX": f"bench{os.getpid()}{int(faults)}",
           "REGEN_LOG_LEVEL": "WARNING"}  # fmt: skip
    settings = Settings.from_env(env)
    out = subprocess.run([*REGEN, "enqueue", "--no-reuse", "--json", str(work / "mix.yaml")], env=env, check=True,
                         capture_output=True, text=True)  # fmt: skip
    run_id = json.loads(out.stdout)["run_id"]
    targets = []
    for u in urls:
        info = httpx.get(f"{u}/get_server_info").json()
        targets.append(
            min(info["max_running_requests"] * 2, info["max_running_requests"] + info["max_queued_requests"])
        )
    endpoint_args = [a for u in urls for a in ("--endpoint", u)]
    worker = subprocess.Popen([*REGEN, "worker", *endpoint_args], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    ledger = Ledger(settings)
    samples, t0, started = [], None, False
    injector = None
    try:
        while True:
            stats = [httpx.get(f"{u}/sim/stats").json() for u in urls if _up(u)]
            outstanding = sum(s["running"] + s["queued"] for s in stats)
            if not started and outstanding:
                started, t0 = True, time.monotonic()
                if faults:
                    injector = subprocess.Popen(
                        [sys.executable, "-c", _INJECT, json.dumps(urls), json.dumps(vars(args))]
                    )
            if started:
                samples.append(outstanding / sum(targets))
            if run_status(ledger, run_id)["state"] == "done":
                break
            if worker.poll() is not None:
                raise RuntimeError(f"the worker exited with {worker.returncode}")
            time.sleep(0.05)
        wall = time.monotonic() - t0
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        if injector:
            injector.wait(timeout=120)
    import pyarrow.parquet as pq

    rows = pq.read_table(work / "data" / "runs" / run_id / "outputs", columns=["prompt_id", "completion_tokens",
                                                                             "error", "attempts"]).to_pylist()  # fmt: skip
    tokens = sum(r["completion_tokens"] or 0 for r in rows)
    keys = list(ledger.r.scan_iter(f"{settings.key_prefix}*"))
    if keys:
        ledger.r.delete(*keys)
    return {"wall_s": round(wall, 2), "output_tokens": tokens, "tok_s": round(tokens / wall, 1),
            "rows": len(rows), "unique_prompts": len({r["prompt_id"] for r in rows}),
            "errors": sum(1 for r in rows if r["error"]),
            "mean_attempts": round(sum(r["attempts"] or 0 for r in rows) / max(1, len(rows)), 3),
            "inflight_over_target": round(sum(samples) / len(samples), 4)}  # fmt: skip


_INJECT = (
    "import asyncio,json,sys,argparse;from scripts.bench_client import inject_faults;"
    "asyncio.run(inject_faults(json.loads(sys.argv[1]),argparse.Namespace(**json.loads(sys.argv[2]))))"
)


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--through", choices=["direct", "worker"], default="direct")
    # >= 5,000; the fixed ramp-up and drain of a finite run cost ~3% at 5K, ~1.5% at 10K
    p.add_argument("--prompts", type=int, default=10000)
    p.add_argument("--sims", type=int, default=3)
    p.add_argument("--decode-tok-s", type=float, default=100.0)
    p.add_argument("--max-running", type=int, default=32)
    # long enough answers that a 30 s outage of one of three sims is a bounded share of the run
    p.add_argument("--answer-len-mean", type=int, default=100)
    p.add_argument("--answer-len-max", type=int, default=250)
    # a coarser scheduler tick means fewer, fatter stream events: the client's CPU is not what is measured
    p.add_argument("--tick-s", type=float, default=0.1)
    p.add_argument("--fault-503-rate", type=float, default=0.1)
    p.add_argument("--outage-s", type=float, default=30.0)
    p.add_argument("--outage-after-s", type=float, default=5.0)
    p.add_argument("--scenario", choices=["both", "clean", "faults"], default="both")
    args = p.parse_args()
    out: dict = {"through": args.through, "prompts": args.prompts, "sims": args.sims}
    for name in ("clean", "faults") if args.scenario == "both" else (args.scenario,):
        with sims(args.sims, args, []) as urls:
            cap = capacity(urls)
            faults = name == "faults"
            if args.through == "direct":
                res = asyncio.run(drive_direct(urls, args, faults))
            else:
                res = drive_worker(urls, args, faults)
            res["capacity_tok_s"] = round(cap, 1)
            res["tok_s_over_capacity"] = round(res["tok_s"] / cap, 4)
            res["target"] = 0.80 if faults else 0.95
            res["pass"] = res["tok_s_over_capacity"] >= res["target"]
            out[name] = res
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
