"""Occupancy of the servers while work remains: one `regen worker` at its defaults against `regen sim`,
per shard size, endpoint count and fault setting; optionally SpecForge's regenerate_train_data.py on
the same simulators and prompts for the ratio. Prints one JSON object.

Occupancy = the time-weighted mean of sum(running) / sum(max_running_requests) over the sims, sampled
every 50 ms from the first request until every prompt has been handed to a server (after that no client
can fill the slots: only the last answers' tails are left), i.e. until the requests the servers
admitted, less those an injected fault failed after admission (regen asks those again; SpecForge does
not, so all its requests count), reach the number of prompts. Faults: 5% 503s, 2% dropped connections.

    python scripts/bench_occupancy.py --prompts 768 --specforge /tmp/specforge-checkout
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis

MODEL = "moonshotai/Kimi-K2.5"
REGEN = [sys.executable, "-c", "from regen_service.cli import main; main()"]
FAULTS = ["--fault-503-rate", "0.05", "--fault-disconnect-rate", "0.02"]


def sims(n: int, args: argparse.Namespace, faults: bool):
    """n simulators of the same capacity (seeds 0..n-1), with or without injected faults."""
    from regen_service.localproc import simulators

    return simulators([
        ["--seed", str(i), "--decode-tok-s", str(args.decode_tok_s), "--max-running-requests", str(args.max_running),
         "--answer-len-mean", str(args.answer_len_mean), "--answer-len-max", str(args.max_new_tokens),
         "--log-level", "WARNING", *(FAULTS if faults else [])]
        for i in range(n)
    ])  # fmt: skip


def _prompts(n: int) -> list[str]:
    return [f"question {i}: explain item {i * 7919 % 10007} in a few sentences" for i in range(n)]


def _measure(urls: list[str], all_handed_out, finished, proc: subprocess.Popen) -> dict:
    """Sample the sims until `finished()`; occupancy over [first request, all_handed_out() first true]."""
    capacity = sum(httpx.get(f"{u}/sim/stats").json()["max_running_requests"] for u in urls)
    samples: list[tuple[float, int]] = []
    t_first = t_handed = None
    with httpx.Client(timeout=5) as c:
        while not finished():
            stats = [c.get(f"{u}/sim/stats").json() for u in urls]
            now, running = time.monotonic(), sum(s["running"] for s in stats)
            at_servers = sum(s["running"] + s["queued"] for s in stats)
            if t_first is None and running:
                t_first = now
            if t_first is not None and t_handed is None:
                samples.append((now, running))
                if all_handed_out(stats, at_servers):
                    t_handed = now
            if proc.poll() is not None and not finished():
                raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode}")
            time.sleep(0.05)
        t_end = time.monotonic()
    area = sum(min(r, capacity) * (t2 - t1) for (t1, r), (t2, _) in itertools.pairwise(samples))
    window = samples[-1][0] - samples[0][0] if len(samples) > 1 else 0.0
    return {"occupancy": round(area / window / capacity, 4) if window else None, "window_s": round(window, 2),
            "wall_s": round(t_end - (t_first or t_end), 2), "slots": capacity}  # fmt: skip


def answered_or_asked(stats: list[dict]) -> int:
    """Requests the sims took that no injected fault failed after admission (regen asks those again;
    a 503 is refused before admission and never counted in requests_total)."""
    failed = ("num_disconnects_injected", "num_error_events_injected", "num_aborts_injected")
    return sum(s["requests_total"] - sum(s[k] for k in failed) for s in stats)


def run_regen(urls: list[str], args: argparse.Namespace, shard_size: int) -> dict:
    from regen_service.settings import Settings
    from regen_service.state.ledger import Ledger
    from regen_service.state.status import run_status

    work = Path(tempfile.mkdtemp(prefix="regen-occ-"))
    (work / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in _prompts(args.prompts)))
    (work / "mix.yaml").write_text(json.dumps({
        "name": "occupancy", "target": {"model": MODEL, "api": "chat"}, "shard_size": shard_size,
        "sampling": {"max_new_tokens": args.max_new_tokens},
        "sources": [{"name": "p", "path": str(work / "p.jsonl"), "format": "prompt_response"}]}))  # fmt: skip
    env = {**os.environ, "REGEN_DATA_ROOT": str(work / "data"), "REGEN_LOG_LEVEL": "WARNING",
           "REGEN_KEY_PREFIX": f"occ{os.getpid()}-{time.monotonic_ns()}"}  # fmt: skip
    settings = Settings.from_env(env)
    out = subprocess.run([*REGEN, "enqueue", "--no-reuse", "--json", str(work / "mix.yaml")], env=env,
                         check=True, capture_output=True, text=True)  # fmt: skip
    run_id = json.loads(out.stdout)["run_id"]
    ledger = Ledger(settings)
    worker = subprocess.Popen([*REGEN, "worker", *[a for u in urls for a in ("--endpoint", u)]], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        res = _measure(
            urls,
            lambda stats, _a: answered_or_asked(stats) >= args.prompts,
            lambda: run_status(ledger, run_id)["state"] == "done",
            worker,
        )
    finally:
        worker.terminate()
        worker.wait(timeout=60)
        r = redis.Redis.from_url(settings.redis_url)
        keys = list(r.scan_iter(f"{settings.key_prefix}*"))
        if keys:
            r.delete(*keys)
    return res


def run_specforge(urls: list[str], args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="specforge-occ-"))
    inp = work / "in.jsonl"
    inp.write_text("".join(json.dumps({"conversations": [{"role": "user", "content": p}]}) + "\n"
                           for p in _prompts(args.prompts)))  # fmt: skip
    cmd = [args.specforge_python, str(Path(args.specforge) / "scripts" / "regenerate_train_data.py"),
           "--model", MODEL, "--concurrency", str(args.max_running), "--max-tokens", str(args.max_new_tokens),
           "--input-file-path", str(inp), "--output-file-path", str(work / "out.jsonl"),
           "--server-address", *[u.removeprefix("http://") for u in urls]]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=args.specforge)
    probes = len(urls)  # its start check sends one 1-token request per server
    try:
        # It never asks a failed prompt again: every request it makes is a prompt handed out.
        res = _measure(urls, lambda stats, _a: sum(s["requests_total"] for s in stats) >= args.prompts + probes,
                       lambda: proc.poll() is not None, proc)  # fmt: skip
    finally:
        proc.wait(timeout=600)
    res["returncode"] = proc.returncode
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=768)
    ap.add_argument("--shard-sizes", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--endpoints", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--faults", choices=["off", "on", "both"], default="both")
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument("--decode-tok-s", type=float, default=100)
    ap.add_argument("--answer-len-mean", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--specforge", default=None, help="a checkout of sgl-project/SpecForge (its scripts/)")
    ap.add_argument("--specforge-python", default=sys.executable, help="a python with openai and tqdm")
    args = ap.parse_args()
    fault_settings = {"off": [False], "on": [True], "both": [False, True]}[args.faults]
    rows = []
    for n in args.endpoints:
        for faults in fault_settings:
            for size in args.shard_sizes:
                with sims(n, args, faults) as urls:
                    rows.append({"client": "regen", "endpoints": n, "faults": faults, "shard_size": size,
                                 **run_regen(urls, args, size)})  # fmt: skip
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            if args.specforge:
                with sims(n, args, faults) as urls:
                    rows.append({"client": "specforge", "endpoints": n, "faults": faults, "shard_size": None,
                                 **run_specforge(urls, args)})  # fmt: skip
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    for row in rows:
        if row["client"] == "regen":
            peer = next((p for p in rows if p["client"] == "specforge" and p["endpoints"] == row["endpoints"]
                         and p["faults"] == row["faults"]), None)  # fmt: skip
            if peer and peer["occupancy"]:
                row["over_specforge"] = round(row["occupancy"] / peer["occupancy"], 3)
    config = {k: v for k, v in vars(args).items() if k not in ("specforge", "specforge_python")}
    print(json.dumps({"config": config, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
