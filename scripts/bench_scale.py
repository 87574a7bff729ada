"""Scale benchmark: an 83K-prompt, ten-source synthetic mix through the simulator with no decode delay.

Prints one JSON object: producer time, end-to-end prompts/s with one worker, Redis memory used by the
run, the worker's peak RSS, and the time from a worker restart (SIGKILL, new process) back to full speed.
Uses its own key prefix and data root, and deletes its keys at the end.

    python scripts/bench_scale.py [--num-prompts 83000] [--no-stream] [--out bench/out/scale.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import redis
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from regen_service.produce.producer import enqueue
from regen_service.settings import Settings
from regen_service.state.ledger import Ledger
from regen_service.state.status import run_status
from tests.procs import regen_cmd, sim_server, spawn, stop

FORMATS = ["sharegpt", "messages", "instruction", "prompt_response", "sharegpt",
           "messages", "instruction", "prompt_response", "messages", "sharegpt"]  # fmt: skip
WORDS = "alpha beta gamma delta model token draft server cache queue shard worker prompt answer".split()


def synth_row(fmt: str, i: int, rng: random.Random) -> dict:
    q = f"[{i}] " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
    a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30)))
    if fmt == "sharegpt":
        return {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
    if fmt == "messages":
        return {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": q},
                             {"role": "assistant", "content": a}]}  # fmt: skip
    if fmt == "instruction":
        return {"instruction": q, "input": "", "output": a}
    return {"prompt": q, "response": a}


def make_mix(root: Path, num_prompts: int) -> Path:
    rng = random.Random(0)
    per = num_prompts // len(FORMATS)
    sources = []
    for k, fmt in enumerate(FORMATS):
        path = root / f"src{k}.jsonl"
        n = per + (num_prompts - per * len(FORMATS) if k == 0 else 0)
        with path.open("w") as f:
            for i in range(n):
                f.write(json.dumps(synth_row(fmt, k * 10_000_000 + i, rng)) + "\n")
        sources.append({"name": f"src{k}", "path": path.name, "format": fmt})
    mix = root / "scale.yaml"
    mix.write_text(yaml.safe_dump({
        "name": "scale", "target": {"model": "moonshotai/Kimi-K2.5", "api": "chat"},
        "sampling": {"max_new_tokens": 64}, "regenerate": {"turns": "last"}, "shard_size": 256, "sources": sources,
    }))  # fmt: skip
    return mix


def rss_tree(proc: psutil.Process) -> int:
    try:
        return proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(recursive=True))
    except psutil.Error:
        return 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=83_000)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    ap.add_argument(
        "--restart-at", type=float, default=0.5, help="kill the worker when this fraction is done"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-stream", action="store_true", help="run the worker with --no-stream")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="regen-scale-"))
    settings = Settings(redis_url=args.redis_url, data_root=str(tmp / "data"), key_prefix=f"bench-{uuid.uuid4().hex[:8]}",
                        lease_ttl_s=10, heartbeat_s=2, visibility_timeout_s=120)  # fmt: skip
    env = {**os.environ, "REGEN_REDIS_URL": settings.redis_url, "REGEN_DATA_ROOT": settings.data_root,
           "REGEN_KEY_PREFIX": settings.key_prefix, "REGEN_LEASE_TTL_S": "10", "REGEN_HEARTBEAT_S": "2",
           "REGEN_VISIBILITY_TIMEOUT_S": "120", "REGEN_LOG_LEVEL": "WARNING"}  # fmt: skip
    r = redis.Redis.from_url(settings.redis_url)
    mem0 = r.info("memory")["used_memory"]
    mix = make_mix(tmp, args.num_prompts)
    t0 = time.perf_counter()
    res = enqueue(settings, mix)
    producer_s = time.perf_counter() - t0
    redis_after_enqueue = r.info("memory")["used_memory"] - mem0
    ledger = Ledger(settings)
    samples: list[tuple[float, int]] = []
    peak_rss = 0
    out: dict = {
        "num_prompts": res.num_prompts,
        "num_shards": res.num_shards,
        "producer_s": round(producer_s, 2),
    }
    with sim_server("--decode-tok-s", "0", "--max-running-requests", "512", log=tmp / "sim.log") as url:
        extra = ["--no-stream"] if args.no_stream else []
        wcmd = regen_cmd("worker", "--endpoint", url, "--hostname", "bench1@local", *extra)
        worker = spawn(wcmd, env=env, log=tmp / "worker.log")
        start = time.perf_counter()
        restarted_at = None
        killed = resumed = False
        try:
            while True:
                st = run_status(ledger, res.run_id)
                now = time.perf_counter() - start
                samples.append((now, st["prompts_done"]))
                peak_rss = max(peak_rss, rss_tree(psutil.Process(worker.pid)))
                if st["state"] == "done":
                    break
                if not killed and st["prompts_done"] >= args.restart_at * res.num_prompts:
                    worker.send_signal(signal.SIGKILL)
                    worker.wait()
                    killed = True
                    worker = spawn(regen_cmd("worker", "--endpoint", url, "--hostname", "bench2@local", *extra), env=env,
                                   log=tmp / "worker2.log")  # fmt: skip
                    restarted_at = time.perf_counter() - start
                if killed and not resumed and now - restarted_at > settings.lease_ttl_s + 1:
                    # the dead worker's leases have expired: an operator's `regen resume` re-queues its shards
                    spawn(regen_cmd("resume", res.run_id), env=env, log=tmp / "resume.log")
                    resumed = True
                if now > 1800:
                    raise TimeoutError("scale run did not finish in 30 minutes")
                time.sleep(0.25)
            redis_peak = r.info("memory")["used_memory"] - mem0
        finally:
            stop(worker)
    total_s = samples[-1][0]

    # steady rate before the kill (1-second windows), and when the restarted worker got back to 90% of it
    def rates(lo: float, hi: float) -> list[tuple[float, float]]:
        pts = [(t, n) for t, n in samples if lo <= t <= hi]
        return [
            ((t1 + t2) / 2, (n2 - n1) / (t2 - t1))
            for (t1, n1), (t2, n2) in zip(pts, pts[4:], strict=False)
            if t2 > t1
        ]

    before = [v for _, v in rates(0, restarted_at or total_s)]
    steady = statistics.median(sorted(before)[len(before) // 4 :]) if before else 0.0
    back = None
    if restarted_at is not None:
        for t, v in rates(restarted_at, total_s):
            if v >= 0.9 * steady:
                back = round(t - restarted_at, 2)
                break
    out.update({
        "end_to_end_s": round(total_s, 1),
        "prompts_per_s_end_to_end": round(res.num_prompts / total_s, 1),
        "prompts_per_s_steady_median": round(steady, 1),
        "redis_bytes_after_enqueue": redis_after_enqueue,
        "redis_bytes_at_end": redis_peak,
        "worker_peak_rss_mb": round(peak_rss / 2**20, 1),
        "restart_to_90pct_speed_s": back,
        "killed_at_fraction": args.restart_at,
        "stream": not args.no_stream,
        "cpu_count": os.cpu_count(),
    })  # fmt: skip
    keys = list(r.scan_iter(f"{settings.key_prefix}*"))
    if keys:
        r.delete(*keys)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
