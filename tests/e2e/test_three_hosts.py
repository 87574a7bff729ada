"""Hosts that share nothing but Redis and the object store (scripts/three_hosts.py, run as an operator
runs it): producer, two workers and the trainer in their own process trees, working directories, HOME
and TMPDIR, on an s3:// root (moto's server); one worker host SIGKILLed mid-shard and brought back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REDIS_URL

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "three_hosts.py"


@pytest.mark.procs
@pytest.mark.timeout(600)
def test_three_hosts_kill_one_worker_exactly_once(tmp_path, redis_available):
    env = {**os.environ, "REGEN_REDIS_URL": REDIS_URL}
    out = subprocess.run([sys.executable, str(SCRIPT), "--prompts", "36", "--shard-size", "6", "--workdir",
                          str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout[out.stdout.index("{") :])
    print(res)
    assert res["answered"] == res["rows"] == 36 and res["duplicated"] == 0
    assert res["trained_shards"] == res["shards"] == 6 and res["trained_twice"] == 0
    assert res["asked"] >= 36
    # no host wrote into another's folder: each one's files are its own
    assert not (tmp_path / "worker-a" / "out").exists() and (tmp_path / "trainer" / "out").is_dir()
