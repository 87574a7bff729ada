"""A pickle planted as a trainer checkpoint never runs: `regen train` (resume) and `regen export` refuse it
with a message naming the file, and the payload's marker file is never written."""

from __future__ import annotations

import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch

from regen_service.train.fixtures import make_tiny_target
from tests.procs import regen_cmd


class _Payload:
    """Unpickling this calls os.system: a real attacker's checkpoint, made harmless (it writes a marker)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"echo pwned > {self.marker}",))


def _plant(out: Path, marker: Path, fmt: str) -> Path:
    step = out / "checkpoints" / "step-00000009"
    step.mkdir(parents=True)
    state = {"step": 9, "draft_state_dict": _Payload(marker)}
    with open(step / "state.pt", "wb") as f:
        pickle.dump(state, f) if fmt == "pickle" else torch.save(state, f)
    (out / "checkpoints" / "latest").write_text("step-00000009\n")
    return step / "state.pt"


@pytest.mark.parametrize("fmt", ["torch.save", "pickle"])
@pytest.mark.parametrize("command", ["train", "export"])
def test_planted_pickle_checkpoint_is_refused_and_never_runs(command, fmt, settings_env, tmp_path):
    out, marker = tmp_path / "out", tmp_path / "PWNED"
    planted = _plant(out, marker, fmt)
    if command == "train":
        target = make_tiny_target(tmp_path / "target", layers=4, hidden=32, heads=4, kv_heads=2)
        # a config that fits the tiny target, so the preflight passes and the resume reads the checkpoint
        config = tmp_path / "train.yaml"
        config.write_text("draft_vocab_size: 512\nmax_length: 256\n")
        cmd = regen_cmd(
            "train", "--run", "run-x", "--target", str(target), "--out", str(out), "--device", "cpu",
            "--config", str(config),
        )  # fmt: skip
    else:
        cmd = regen_cmd("export", str(out), "--out", str(tmp_path / "draft"))
    res = subprocess.run(cmd, env={**os.environ, **settings_env}, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert not marker.exists(), "the planted checkpoint ran its payload"
    assert str(planted) in res.stderr and "refused to load" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
