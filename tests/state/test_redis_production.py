"""Redis as production runs it, on private redis-servers this test starts (never the shared one):
password plus TLS with a certificate the test makes, a restart with AOF on in the middle of a run, and
bad TLS or password refused in one line before any work. Real redis-server, real workers, the simulator."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from regen_service.redis_server import private_redis, redis_server_binary
from regen_service.settings import Settings
from regen_service.state.ledger import Ledger
from tests.e2e.test_exactly_once import output_rows, sim_stats, write_prompt_mix
from tests.procs import free_port, regen_cmd, sim_server, spawn, stop, wait_exit, wait_progress, wait_run_done

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server binary")
PASSWORD = "s3cret-Pa55"


def make_certs(d: Path) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it, made with openssl."""
    d.mkdir(parents=True, exist_ok=True)
    run = lambda *a: subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
        "-subj", "/CN=regen-test-ca")  # fmt: skip
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "server.crt", "-days", "1", "-extfile", "san.ext")  # fmt: skip
    # another CA that signed nothing: a certificate that does not verify against it
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "other.key", "-out", "other.crt", "-days",
        "1", "-subj", "/CN=someone-else")  # fmt: skip
    return {k: d / f"{k}.crt" for k in ("ca", "server", "other")} | {"key": d / "server.key"}


def _env(settings: Settings) -> dict[str, str]:
    env = {"REGEN_REDIS_URL": settings.redis_url, "REGEN_DATA_ROOT": settings.data_root,
           "REGEN_KEY_PREFIX": settings.key_prefix, "REGEN_LEASE_TTL_S": str(settings.lease_ttl_s),
           "REGEN_HEARTBEAT_S": str(settings.heartbeat_s), "REGEN_VISIBILITY_TIMEOUT_S": "3600"}  # fmt: skip
    if settings.redis_ca_certs:
        env["REGEN_REDIS_CA_CERTS"] = settings.redis_ca_certs
    return env


def _cli(args, env) -> subprocess.CompletedProcess:
    return subprocess.run(
        regen_cmd(*args), env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


def test_password_and_tls(tmp_path):
    certs = make_certs(tmp_path / "certs")
    port = free_port()
    args = ("--port", "0", "--tls-port", str(port), "--tls-cert-file", str(certs["server"]), "--tls-key-file",
            str(certs["key"]), "--tls-ca-cert-file", str(certs["ca"]), "--tls-auth-clients", "no",
            "--requirepass", PASSWORD, "--appendonly", "no")  # fmt: skip
    tls = {"ssl": True, "ssl_ca_certs": str(certs["ca"]), "password": PASSWORD}
    with private_redis(tmp_path / "redis", *args, port=port, client_kwargs=tls):
        url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0"
        settings = Settings(redis_url=url, data_root=str(tmp_path / "data"), key_prefix="regentest-tls",
                            lease_ttl_s=6.0, heartbeat_s=1.0, redis_ca_certs=str(certs["ca"]))  # fmt: skip
        env = _env(settings)
        mix = write_prompt_mix(tmp_path, "tls", 20, 5)
        # Bad input first: one line each, before any work (no run folder, nothing in Redis).
        bad = {
            "refused the password": {**env, "REGEN_REDIS_URL": url.replace(PASSWORD, "wrong")},
            "TLS failed": {**env, "REGEN_REDIS_CA_CERTS": str(certs["other"])},
        }
        for words, bad_env in bad.items():
            for cmd in (("enqueue", str(mix)), ("worker", "--endpoint", "http://127.0.0.1:9")):
                out = _cli(cmd, bad_env)
                lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
                assert out.returncode != 0 and len(lines) == 1 and words in lines[0], (cmd, out.stderr)
                assert PASSWORD not in lines[0] and "wrong" not in lines[0].replace("wrong password", "")
        assert not (tmp_path / "data" / "runs").exists()
        assert Ledger(settings).run_ids() == []

        out = _cli(("enqueue", str(mix), "--json"), env)
        assert out.returncode == 0, out.stderr
        run_id = json.loads(out.stdout)["run_id"]
        with sim_server("--decode-tok-s", "0") as sim:
            w = spawn(regen_cmd("worker", "--endpoint", sim), env=env, log=tmp_path / "w.log")
            try:
                st = wait_run_done(settings, run_id, procs=(w,), timeout_s=90)
            finally:
                stop(w)
        status = _cli(("status", run_id), env)
        assert status.returncode == 0 and "done" in status.stdout
    assert st["prompts_done"] == 20 == len({r["prompt_id"] for r in output_rows(settings, run_id)})
    for text in (status.stdout, status.stderr, (tmp_path / "w.log").read_text()):
        assert PASSWORD not in text


def test_redis_crash_with_aof_mid_run(tmp_path):
    """Redis SIGKILLed mid-run and started again on its AOF (appendfsync always): the worker waits
    through the outage (or, when Celery's reconnect fails, exits 1 saying so and is restarted as its
    supervisor would), status says what is wrong meanwhile, the run ends exactly once."""
    with private_redis(tmp_path / "redis", "--appendonly", "yes", "--appendfsync", "always") as server:
        settings = Settings(redis_url=server.url, data_root=str(tmp_path / "data"), key_prefix="regentest-aof",
                            lease_ttl_s=6.0, heartbeat_s=1.0)  # fmt: skip
        env = _env(settings)
        out = _cli(("enqueue", str(write_prompt_mix(tmp_path, "aof", 60, 6)), "--json"), env)
        assert out.returncode == 0, out.stderr
        run_id = json.loads(out.stdout)["run_id"]
        ledger = Ledger(settings)
        sim_args = ("--decode-tok-s", "30", "--answer-len-mean", "20", "--max-running-requests", "8")
        with sim_server(*sim_args) as sim:
            w = spawn(regen_cmd("worker", "--endpoint", sim, "--max-inflight-per-endpoint", "4"), env=env,
                      log=tmp_path / "w.log")  # fmt: skip
            try:
                wait_progress(lambda: (ledger.run_counters(run_id).shard_states.get(1) == "done",
                                       ledger.run_counters(run_id).prompts_done), what="two shards",
                              stall_s=60, procs=(w,))  # fmt: skip
                server.stop(signal.SIGKILL)
                down = _cli(("status", run_id), env)
                lines = [ln for ln in down.stderr.splitlines() if ln.strip()]
                assert down.returncode != 0 and len(lines) == 1 and "not reachable" in lines[0], down.stderr
                wlog = tmp_path / "w.log"
                wait_progress(lambda: ("Connection to broker lost" in wlog.read_text(), wlog.stat().st_size),
                              what="the worker to notice", stall_s=30, procs=(w,))  # fmt: skip
                server.start()  # same port, same directory: the AOF is replayed
                restarts = 0
                while True:
                    try:
                        st = wait_run_done(settings, run_id, procs=(w,), timeout_s=120)
                        break
                    except RuntimeError:
                        # The supervisor's part (compose.yaml: restart: unless-stopped). kombu 5.7's Redis
                        # channel can fail its own reconnect (AttributeError in _connparams: the transport's
                        # client already gone while it restores unacked messages); Celery then stops as on
                        # an unrecoverable error, and regen's worker exits 1 and says so, for a restart.
                        log = (tmp_path / ("w.log" if not restarts else f"w{restarts}.log")).read_text()
                        assert w.poll() == 1 and "exiting 1 for the supervisor" in log and restarts < 2, log[
                            -3000:
                        ]
                        restarts += 1
                        w = spawn(regen_cmd("worker", "--endpoint", sim, "--max-inflight-per-endpoint", "4"),
                                  env=env, log=tmp_path / f"w{restarts}.log")  # fmt: skip
            finally:
                stop(w)
            stats = sim_stats(sim)
    rows = output_rows(settings, run_id)
    assert len(rows) == len({r["prompt_id"] for r in rows}) == 60 == st["prompts_done"]
    print(
        f"redis crash + AOF restart: 60 prompts done once, {stats['requests_total']} asked, {restarts} restarts"
    )
    assert stats["requests_total"] <= 60 + 4 * (2 + restarts)  # each stop loses at most what was in flight


def test_redis_full_under_noeviction_mid_run(tmp_path):
    """maxmemory reached under noeviction mid-run: Redis refuses every write; status says so, the worker
    exits non-zero (Celery cannot consume), and once Redis has room again the restarted worker ends the
    run exactly once."""
    import redis

    with private_redis(
        tmp_path / "redis", "--appendonly", "no", "--maxmemory-policy", "noeviction"
    ) as server:
        settings = Settings(redis_url=server.url, data_root=str(tmp_path / "data"), key_prefix="regentest-oom",
                            lease_ttl_s=6.0, heartbeat_s=1.0)  # fmt: skip
        env = _env(settings)
        out = _cli(("enqueue", str(write_prompt_mix(tmp_path, "oom", 60, 6)), "--json"), env)
        assert out.returncode == 0, out.stderr
        run_id = json.loads(out.stdout)["run_id"]
        ledger = Ledger(settings)
        admin = redis.Redis.from_url(server.url)
        sim_args = ("--decode-tok-s", "30", "--answer-len-mean", "20", "--max-running-requests", "8")
        with sim_server(*sim_args) as sim:
            w = spawn(regen_cmd("worker", "--endpoint", sim, "--max-inflight-per-endpoint", "4"), env=env,
                      log=tmp_path / "w.log")  # fmt: skip
            try:
                wait_progress(lambda: (ledger.run_counters(run_id).shard_states.get(1) == "done",
                                       ledger.run_counters(run_id).prompts_done), what="two shards",
                              stall_s=60, procs=(w,))  # fmt: skip
                admin.config_set("maxmemory", 1)  # full: every write is refused from now on
                full = _cli(("status", run_id), env)
                assert full.returncode == 0 and "refuses writes" in full.stdout, full.stdout + full.stderr
                # Celery's consumer cannot run on a Redis that refuses writes: the worker fails loudly,
                # non-zero, for its supervisor; the rows it answered are in the shard logs on storage.
                code = wait_exit(w, tmp_path / "w.log", stall_s=60)
                assert code != 0 and "exiting 1 for the supervisor" in (tmp_path / "w.log").read_text()
                admin.config_set("maxmemory", 0)
                # the supervisor's restart
                w = spawn(regen_cmd("worker", "--endpoint", sim, "--max-inflight-per-endpoint", "4"), env=env,
                          log=tmp_path / "w2.log")  # fmt: skip
                st = wait_run_done(settings, run_id, procs=(w,), timeout_s=120)
            finally:
                stop(w)
            stats = sim_stats(sim)
    rows = output_rows(settings, run_id)
    assert len(rows) == len({r["prompt_id"] for r in rows}) == 60 == st["prompts_done"]
    print(f"redis full (noeviction) mid-run: 60 prompts done once, {stats['requests_total']} asked")
    assert stats["requests_total"] <= 60 + 4 * 2
