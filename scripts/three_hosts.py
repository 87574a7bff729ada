"""Hosts that share nothing but Redis and the object store: a producer, two workers and a trainer, each
its own process tree with its own working directory, HOME and TMPDIR (no local path in common), on an
s3:// data root. One worker host is SIGKILLed mid-shard and brought back; the run must end exactly once
and the trainer must consume every shard once. Prints one JSON object: asked, answered, duplicated,
trained, and the times.

The "hosts" are separate processes on loopback (no network namespaces: Redis and the S3 server are
reached at 127.0.0.1). The S3 API is moto's server (tests/s3.py) unless the AWS_* variables and
--data-root name a real one. Redis is REGEN_REDIS_URL's, under a key prefix of this run's own.

    python scripts/three_hosts.py --prompts 48 --shard-size 6
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from regen_service.localproc import free_port, regen_cmd, spawn, stop, wait_http
from regen_service.settings import Settings
from regen_service.state.ledger import Ledger
from regen_service.state.status import run_status


def host_dir(base: Path, name: str) -> dict[str, str]:
    """A host's own folder: its cwd, HOME and TMPDIR."""
    d = base / name
    (d / "tmp").mkdir(parents=True, exist_ok=True)
    return {"HOME": str(d), "TMPDIR": str(d / "tmp")}


def run_host(base: Path, name: str, cmd: list[str], env: dict) -> object:
    h = host_dir(base, name)
    return spawn(cmd, env={**env, **h}, log=base / name / "log.txt", cwd=Path(h["HOME"]))


def wait_for(pred, what: str, stall_s: float = 120.0, procs: tuple = ()):
    """Poll until pred() is truthy; fail when its value stands still for stall_s or a process exits."""
    last, changed = None, time.monotonic()
    while True:
        value = pred()
        if value:
            return value
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"a host exited ({p.returncode}) while waiting for {what}")
        if value != last:
            last, changed = value, time.monotonic()
        if time.monotonic() - changed > stall_s:
            raise TimeoutError(f"{what}: nothing moved for {stall_s:.0f}s")
        time.sleep(0.3)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--shard-size", type=int, default=6)
    ap.add_argument("--data-root", default=None, help="s3://bucket/prefix of a real store [default: moto]")
    ap.add_argument("--workdir", default=None, help="where the hosts' folders go [default: a temp dir]")
    args = ap.parse_args(argv)
    base = Path(args.workdir or tempfile.mkdtemp(prefix="regen-3hosts-")).resolve()
    prefix = f"regen3h-{uuid.uuid4().hex[:8]}"
    redis_url = Settings.from_env().redis_url
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        if args.data_root:
            s3_env, root = {}, args.data_root
        else:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            from tests.s3 import BUCKET, moto_s3

            (base / "s3").mkdir(parents=True, exist_ok=True)
            s3 = stack.enter_context(moto_s3(base / "s3"))
            s3_env, root = s3.env, f"s3://{BUCKET}/{prefix}"
            os.environ.update(s3_env)  # this process reads the outputs back at the end, like any host
        env = {**s3_env, "REGEN_REDIS_URL": redis_url, "REGEN_DATA_ROOT": root, "REGEN_KEY_PREFIX": prefix,
               "REGEN_LEASE_TTL_S": "5", "REGEN_HEARTBEAT_S": "1"}  # fmt: skip
        settings = Settings(
            redis_url=redis_url, data_root=root, key_prefix=prefix, lease_ttl_s=5, heartbeat_s=1
        )
        ledger = Ledger(settings)
        try:
            return _run(args, base, env, settings, ledger, t0)
        finally:
            keys = list(ledger.r.scan_iter(f"{prefix}*", count=1000))
            if keys:
                ledger.r.delete(*keys)


def _run(args, base: Path, env: dict, settings: Settings, ledger: Ledger, t0: float) -> dict:
    # producer host: the mix and its source file exist only here
    prod = base / "producer"
    host_dir(base, "producer")
    with (prod / "prompts.jsonl").open("w") as f:
        for i in range(args.prompts):
            f.write(json.dumps({"prompt": f"question {i}: explain item {i * 7919 % 10007} briefly"}) + "\n")
    (prod / "mix.yaml").write_text(yaml.safe_dump({
        "name": "three-hosts", "target": {"model": "moonshotai/Kimi-K2.5", "api": "chat"},
        "sampling": {"max_new_tokens": 64}, "shard_size": args.shard_size,
        "sources": [{"name": "prompts", "path": "prompts.jsonl", "format": "prompt_response"}],
    }))  # fmt: skip
    p = run_host(base, "producer", regen_cmd("enqueue", "mix.yaml", "--json"), env)
    if p.wait(timeout=300) != 0:
        raise RuntimeError(f"enqueue failed: {(prod / 'log.txt').read_text()[-2000:]}")
    out = (prod / "log.txt").read_text()
    res = json.loads(out[out.index("{") : out.rindex("}") + 1])
    run_id, num_shards = res["run_id"], res["num_shards"]

    # the GPU server's stand-in, and the trainer host's target model (only the trainer has it)
    port = free_port()
    sim = run_host(base, "gpu-server", regen_cmd("sim", "--port", str(port), "--decode-tok-s", "30",
                                                 "--answer-len-mean", "20", "--max-running-requests", "16"), env)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    hosts = [sim]
    try:
        wait_http(f"{url}/health", timeout_s=60, proc=sim)
        from regen_service.train.fixtures import make_tiny_target

        target = make_tiny_target(base / "trainer" / "target", layers=4, hidden=32, heads=4, kv_heads=2)
        (base / "trainer").mkdir(exist_ok=True)
        (base / "trainer" / "train.yaml").write_text(yaml.safe_dump({
            "draft_vocab_size": 256, "max_length": 128, "batch_size": 4, "epochs": 1, "ttt_length": 2,
            "eval_fraction": 0.0, "poll_s": 0.3,
        }))  # fmt: skip
        trainer = run_host(base, "trainer", regen_cmd("train", "--run", run_id, "--target", str(target), "--out",
                                                      "out", "--config", "train.yaml", "--device", "cpu",
                                                      "--follow"), env)  # fmt: skip
        hosts.append(trainer)
        wargs = ("--endpoint", url, "--max-inflight-per-endpoint", "4")
        a = run_host(base, "worker-a", regen_cmd("worker", *wargs, "--hostname", "a@host-a"), env)
        b = run_host(base, "worker-b", regen_cmd("worker", *wargs, "--hostname", "b@host-b"), env)
        hosts += [a, b]

        def a_mid_shard():
            states = ledger.shard_states(run_id)
            held = [s for s, (h, _) in ledger.leases(run_id, states).items() if h.startswith("a@host-a")]
            return bool(held) and ledger.run_counters(run_id).prompts_done > 0

        wait_for(a_mid_shard, "worker a mid-shard", procs=(a, b))
        os.killpg(a.pid, signal.SIGKILL)  # the host dies: its whole process tree
        a.wait()
        t_kill = time.monotonic()
        a = run_host(base, "worker-a", regen_cmd("worker", *wargs, "--hostname", "a@host-a"), env)  # back
        hosts.append(a)
        wait_for(
            lambda: (st := run_status(ledger, run_id)) and st["state"] == "done", "the run", procs=(a, b)
        )
        run_s, kill_to_done_s = time.monotonic() - t0, time.monotonic() - t_kill
        code = trainer.wait(timeout=600)
        if code != 0:
            raise RuntimeError(f"trainer exited {code}: {(base / 'trainer' / 'log.txt').read_text()[-2000:]}")
        asked = httpx.get(f"{url}/sim/stats", timeout=5).json()["requests_total"]
    finally:
        for h in hosts:
            stop(h)
    from regen_service.draft.checkpoint import load_latest
    from regen_service.state.storage import RunLayout, Storage

    layout = RunLayout(Storage(settings.data_root), run_id)
    rows = []
    for sid in sorted(layout.output_shard_ids()):
        with layout.storage.fs.open(layout.output_shard(sid), "rb") as f:
            rows += pq.read_table(f, columns=["prompt_id"]).to_pylist()
    ids = [r["prompt_id"] for r in rows]
    consumed = [tuple(k) for k in load_latest(base / "trainer" / "out")["consumed_shards"]]
    return {
        "hosts": "separate process trees on loopback (no network namespaces), own cwd/HOME/TMPDIR each",
        "data_root": settings.data_root, "prompts": args.prompts, "shards": num_shards,
        "asked": asked, "answered": len(set(ids)), "rows": len(ids), "duplicated": len(ids) - len(set(ids)),
        "trained_shards": len(consumed), "trained_twice": len(consumed) - len(set(consumed)),
        "run_done_s": round(run_s, 1), "kill_to_done_s": round(kill_to_done_s, 1),
        "workdir": str(base),
    }  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
