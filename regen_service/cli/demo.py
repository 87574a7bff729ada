"""`regen demo`: the whole pipeline on one machine, as the README's first command.

Starts the simulator (instead of a GPU server) and one worker as separate processes, enqueues the
bundled sample mix (five formats, planted bad rows, a small Kimi-style tokenizer), waits for the run,
then prints where the shards are and a per-source summary read back from the Parquet files. Uses the
Redis already running (REGEN_REDIS_URL) and the data root (REGEN_DATA_ROOT, default ./data). The
bundled mix, data and tokenizer are files in regen_service/demo/ (no code there): this module is the
`regen demo` command's, so it sits in cli/ and the folder's name is the data's alone.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import redis

from regen_service.errors import ConfigError
from regen_service.localproc import free_port, regen_cmd, spawn, stop, wait_http
from regen_service.produce.producer import enqueue
from regen_service.redis_server import INSTALL_HINT, private_redis, redis_server_binary
from regen_service.settings import Settings
from regen_service.state.find_runs import demo_settings
from regen_service.state.ledger import Ledger
from regen_service.state.status import run_status
from regen_service.work.metrics import row_outcome
from schemas.rows import OutputRow

DEMO_DIR = Path(__file__).resolve().parents[1] / "demo"  # the bundled data: regen_service/demo/
DEMO_MIX = DEMO_DIR / "mix.yaml"


def summarize(settings: Settings, run_id: str) -> str:
    """Per-source counts read back from the run's files with `datasets`, as a user would check them."""
    import datasets

    from regen_service.state.runinfo import load_manifest
    from regen_service.state.storage import RunLayout, Storage

    layout = RunLayout(Storage(settings.data_root_resolved), run_id)
    manifest = load_manifest(layout)
    files = sorted(p for p in layout.storage.ls(layout.outputs_dir) if p.endswith(".parquet"))
    if not files:
        return f"run {run_id}: no output shards under {layout.outputs_dir}"
    ds = datasets.load_dataset("parquet", data_files=files, split="train")
    # The worker's own outcome rule (the `regen_rows_finished_total` labels): a pretokenized row is
    # passed through without an engine call, so it is not "answered"; reused answers and errors apart.
    counts: dict[str, dict[str, int]] = {}
    tokens: dict[str, int] = {}
    columns = ("source", "error_class", "reused_from", "turns", "completion_tokens")
    for rec in ds.select_columns(list(columns)):
        outcome = row_outcome(OutputRow.from_record(rec))
        kind = outcome if outcome in ("answered", "passthrough", "reused") else "errors"
        per = counts.setdefault(rec["source"], {})
        per[kind] = per.get(kind, 0) + 1
        tokens[rec["source"]] = tokens.get(rec["source"], 0) + (rec["completion_tokens"] or 0)
    kinds = ("answered", "passthrough", "reused", "errors")
    lines = [
        f"run {run_id}: {len(ds)} rows in {len(files)} shards",
        f"  output shards: {layout.outputs_dir}/shard-*.parquet",
        f"  quarantine:    {layout.quarantine_path}",
        f"  {'source':<20}{'read':>6}{'kept':>6}{'dup':>6}{'quar':>6}"
        + "".join(f"{k:>{len(k) + 2}}" for k in kinds)
        + f"{'tokens':>9}",
    ]
    for name, st in manifest.sources.items():
        per = counts.get(name, {})
        lines.append(
            f"  {name:<20}{st.read:>6}{st.kept:>6}{st.duplicate:>6}{st.quarantined:>6}"
            + "".join(f"{per.get(k, 0):>{len(k) + 2}}" for k in kinds)
            + f"{tokens.get(name, 0):>9}"
        )
    return "\n".join(lines)


def run_demo(settings: Settings, mix_path: str | None = None, timeout_s: float = 300.0) -> int:
    """The demo on the Redis of settings.redis_url, or, when none answers there, on a private
    redis-server started for it (stopped at the end); without one on PATH: one line saying how to
    install it."""
    try:
        redis.Redis.from_url(settings.redis_url, socket_connect_timeout=3).ping()
    except redis.RedisError as e:
        if redis_server_binary() is None:
            raise ConfigError(
                f"Redis at {settings.redis_url_redacted} is not reachable ({e}) and there is no redis-server "
                f"on PATH to start a private one: install it with {INSTALL_HINT}"
            ) from None
        with private_redis(Path(settings.data_root_resolved) / "demo-redis", "--appendonly", "no") as server:
            print(f"no Redis at {settings.redis_url_redacted}: started a private redis-server at {server.url} "
                  "for this demo (stopped when it ends)", flush=True)  # fmt: skip
            return _run_demo(settings.model_copy(update={"redis_url": server.url}), mix_path, timeout_s,
                             private=True)  # fmt: skip
    return _run_demo(settings, mix_path, timeout_s)


def _run_demo(settings: Settings, mix_path: str | None, timeout_s: float, private: bool = False) -> int:
    t0 = time.monotonic()
    mix = Path(mix_path) if mix_path else DEMO_MIX
    # The demo's runs live in a namespace of this data root's own, so demos started from two folders
    # on one Redis never see each other's ledger; `regen status` and `regen runs` look there too.
    settings = demo_settings(settings)
    logs = Path(settings.data_root_resolved) / "demo-logs"
    env = {"REGEN_REDIS_URL": settings.redis_url, "REGEN_DATA_ROOT": settings.data_root_resolved,
           "REGEN_KEY_PREFIX": settings.key_prefix}  # fmt: skip
    port = free_port()
    sim = spawn(
        regen_cmd("sim", "--port", str(port), "--tokenizer", str(DEMO_DIR / "tokenizer"), "--model",
                  "moonshotai/Kimi-K2.5", "--decode-tok-s", "400", "--max-running-requests", "64",
                  "--answer-len-mean", "60", "--think-prob", "0.5", "--tool-call-prob", "0.3"),
        env, logs / "sim.log",
    )  # fmt: skip
    worker = None
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http(f"{url}/health", timeout_s=60, proc=sim)
        except (RuntimeError, TimeoutError) as e:
            raise ConfigError(f"the simulator did not come up ({e}); see {logs / 'sim.log'}") from None
        print(f"simulator up at {url} (log: {logs / 'sim.log'})", flush=True)
        node = f"regen-demo@{socket.gethostname()}-{port}"
        worker = spawn(regen_cmd("worker", "--endpoint", url, "--hostname", node), env, logs / "worker.log")
        res = enqueue(settings, mix)
        print(res.message, flush=True)
        ledger = Ledger(settings)
        last = ""
        while True:
            st = run_status(ledger, res.run_id)
            line = f"  {st['state']}: {st['prompts_done']}/{st['prompts_total']} prompts, " \
                   f"{st['shards_done']}/{st['shards_total']} shards, {st['tokens_per_s']} tok/s"  # fmt: skip
            if line != last:
                print(line, flush=True)
                last = line
            if st["state"] in ("done", "failed"):
                break
            if worker.poll() is not None:
                raise ConfigError(f"the worker exited ({worker.returncode}); see {logs / 'worker.log'}")
            if time.monotonic() - t0 > timeout_s:
                raise ConfigError(f"the demo run did not finish in {timeout_s:.0f}s; see {logs}")
            time.sleep(0.5)
        print(summarize(settings, res.run_id), flush=True)
        check = (f"its outputs stay under {settings.data_root_resolved}/runs/{res.run_id} (the private Redis goes "
                 "with the demo; `regen runs` lists the run from storage)" if private
                 else f"check it with: regen status {res.run_id[:8]}")  # fmt: skip
        print(f"demo finished in {time.monotonic() - t0:.1f}s; {check}", flush=True)
        return 0 if st["state"] == "done" else 1
    finally:
        if worker is not None:
            stop(worker)
        stop(sim)
