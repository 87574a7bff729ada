"""The vLLM target backend against an engine whose replies name hostile files (issue 18, item 2).

A real HTTP server stands in for the engine's `/v1/models` and `/v1/completions`; each reply's
`kv_transfer_params.hidden_states_path` is the planted hostile input. The trainer must never read or
delete a file outside `target_states_dir`, must not hang on a lock nobody releases, and must say in one
line what is wrong with a file that is not a states file.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from regen_service.train.engine_target import EngineStateError, VllmTarget
from tests.procs import regen_cmd

H, V, LAYERS = 8, 20, 8


@pytest.fixture
def target_dir(tmp_path) -> Path:
    d = tmp_path / "target"
    d.mkdir()
    cfg = {"hidden_size": H, "num_hidden_layers": LAYERS, "vocab_size": V, "rms_norm_eps": 1e-6}
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({"model.embed_tokens.weight": torch.ones(V, H), "model.norm.weight": torch.ones(H)},
              str(d / "model.safetensors"))  # fmt: skip
    return d


@pytest.fixture
def engine():
    """A real HTTP server answering like vLLM; `engine.path` is the hidden_states_path it replies with."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _json(self, body: dict) -> None:
            raw = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            self._json({"data": [{"id": "tiny"}]})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            kv = {"hidden_states_path": server.path}
            self._json({"choices": [{"token_ids": [3]}], "kv_transfer_params": kv})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.path = None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    server.url = f"http://127.0.0.1:{server.server_port}"
    yield server
    server.shutdown()


def _states_file(path: Path, payload: bytes | None = None) -> bytes:
    if payload is None:
        save_file({"hidden_states": torch.ones(8, 4, H), "token_ids": torch.arange(8)}, str(path))
    else:
        path.write_bytes(payload)
    Path(str(path) + ".lock").write_text("")
    return path.read_bytes()


def _victims(tmp_path: Path) -> dict[str, tuple[Path, bytes]]:
    """Files the engine's reply points at: another run's states file (and its lock), a model's weights."""
    other = tmp_path / "other-run-states"
    other.mkdir()
    weights = tmp_path / "models" / "model-00001.safetensors"
    weights.parent.mkdir()
    return {
        "other_run": (other / "req-1.safetensors", _states_file(other / "req-1.safetensors")),
        "other_lock": (other / "req-1.safetensors.lock", b""),
        "weights": (weights, _states_file(weights, b"\0" * 4096)),
    }


def _hostile_paths(tmp_path: Path, states: Path, victims: dict) -> dict[str, str]:
    (states / "link.safetensors").symlink_to(victims["other_run"][0])
    Path(str(states / "link.safetensors") + ".lock").write_text("")
    return {
        "other_run": str(victims["other_run"][0]),
        "weights": str(victims["weights"][0]),
        "etc_passwd": "/etc/passwd",
        "dotdot": str(states / ".." / "other-run-states" / "req-1.safetensors"),
        "relative": "../models/model-00001.safetensors",
        "symlink_out": str(states / "link.safetensors"),
        "not_a_string": 12,
    }


@pytest.mark.parametrize(
    "case", ["other_run", "weights", "etc_passwd", "dotdot", "relative", "symlink_out", "not_a_string"]
)
def test_a_path_outside_the_states_dir_is_never_read_or_deleted(case, engine, target_dir, tmp_path):
    states = tmp_path / "states"
    states.mkdir()
    victims = _victims(tmp_path)
    engine.path = _hostile_paths(tmp_path, states, victims)[case]
    with pytest.raises(EngineStateError) as err:
        VllmTarget(str(target_dir), engine.url, states_dir=states, request_timeout_s=5)
    msg = str(err.value)
    assert "\n" not in msg and ("target_states_dir" in msg or "not a file path" in msg), msg
    for path, content in victims.values():
        assert path.read_bytes() == content, f"{path} was touched"


def test_a_held_lock_ends_in_a_clear_error_not_a_hang(engine, target_dir, tmp_path):
    states = tmp_path / "states"
    states.mkdir()
    path = states / "req-7.safetensors"
    _states_file(path)
    engine.path = str(path)
    with open(str(path) + ".lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # an engine (or anyone) that never lets go
        t0 = time.monotonic()
        with pytest.raises(EngineStateError, match=r"still locked after 1 s"):
            VllmTarget(str(target_dir), engine.url, states_dir=states, request_timeout_s=1)
        assert time.monotonic() - t0 < 5
    assert path.exists()  # not read, so not deleted


@pytest.mark.parametrize(
    ("payload", "expect"),
    [
        (b"root:x:0:0:root:/root:/bin/bash\n", "is not a states file"),
        (None, "holds {'weights'"),  # a valid safetensors file of another kind
    ],
)
def test_a_file_that_is_not_a_states_file_is_one_line(payload, expect, engine, target_dir, tmp_path):
    states = tmp_path / "states"
    states.mkdir()
    path = states / "req-8.safetensors"
    if payload is None:
        save_file({"weights": torch.ones(3)}, str(path))
        Path(str(path) + ".lock").write_text("")
    else:
        _states_file(path, payload)
    engine.path = str(path)
    with pytest.raises(EngineStateError) as err:
        VllmTarget(str(target_dir), engine.url, states_dir=states, request_timeout_s=5)
    msg = str(err.value)
    assert expect in msg and str(path) in msg and "expected hidden_states" in msg and "\n" not in msg


def test_train_with_the_vllm_backend_needs_the_states_dir(settings_env, tmp_path):
    res = subprocess.run(
        regen_cmd(
            "train",
            "--run",
            "r-1",
            "--target",
            str(tmp_path),
            "--out",
            str(tmp_path / "out"),
            "--target-backend",
            "vllm",
            "--target-endpoint",
            "http://127.0.0.1:9",
        ),
        env={**os.environ, **settings_env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "target_states_dir" in res.stderr and "--hidden-states DIR" in res.stderr
