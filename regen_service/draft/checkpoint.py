"""Trainer checkpoints: OUT/checkpoints/step-00000123/state.pt plus OUT/checkpoints/latest (and `best`).

The state is written into a temporary directory, fsynced and renamed into place; only then is the
text file `latest` replaced (atomically) with the step directory's name, so a reader (a resuming
trainer, `regen export`) never sees a half checkpoint. Keys of state.pt (a fixed contract; `regen
export` reads them): draft_state_dict (SGLang names incl. d2t/t2d, no embed_tokens), draft_config,
aux_layer_ids (layer INPUT indices captured), target_num_layers, optimizer, scheduler, step,
train_config, consumed_shards (list of [run_id, shard_id]), in_progress (None, or the shard being
trained and the next batch index in it), plus vocab_stats and target_path. `best` (written by
`mark_best`, same format as `latest`) names the step directory with the best held-out accept length;
pruning keeps it whatever its age. Imports torch only.

Loading never runs code: `torch.load(weights_only=True)` (tensors, numbers, strings, lists, dicts:
all the state holds), so a pickle planted in the output directory (it sits on a volume every worker
writes) is refused with UnsafeCheckpointError naming the file, instead of executing its payload.
"""

from __future__ import annotations

import os
import pickle
import shutil
import uuid
import zipfile
from pathlib import Path

import torch
from torch.torch_version import TorchVersion

from regen_service.errors import ConfigError

REQUIRED_KEYS = (
    "draft_state_dict",
    "draft_config",
    "aux_layer_ids",
    "target_num_layers",
    "optimizer",
    "scheduler",
    "step",
    "train_config",
    "consumed_shards",
    "in_progress",
)


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(out_dir: str | Path, state: dict, keep: int = 3) -> Path:
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise ValueError(f"checkpoint state lacks {missing}")
    root = Path(out_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = step_dir_name(int(state["step"]))
    tmp = root / f".tmp-{uuid.uuid4().hex[:8]}-{name}"
    tmp.mkdir()
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    final = root / name
    if final.exists():  # same step saved again (e.g. a resumed trainer with no new step): replace
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = root / f".latest-{uuid.uuid4().hex[:8]}"
    latest_tmp.write_text(name + "\n")
    os.replace(latest_tmp, root / "latest")
    _fsync_dir(root)
    _prune(root, keep, name)
    return final


def _prune(root: Path, keep: int, current: str) -> None:
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    best = _pointer(root / "best")  # the best checkpoint by held-out eval is never pruned
    for p in steps[:-keep]:
        if p.name not in (current, best):
            shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".tmp-*"):  # left by a trainer killed mid-write
        shutil.rmtree(p, ignore_errors=True)


def latest_step(root: str | Path) -> Path | None:
    """The step directory `root/latest` names (root: a trainer's checkpoints/ folder), or None without
    one. The name must be a step directory right inside root, symlinks resolved: `latest` sits on a
    volume others write, and a name leading elsewhere would load (or export) a file from anywhere."""
    root = Path(root)
    try:
        name = (root / "latest").read_text(encoding="utf-8", errors="replace").strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise ConfigError(f"{root / 'latest'}: cannot read it ({e.strerror})") from None
    step = root / name
    if (
        not name.startswith("step-")
        or "/" in name
        or os.path.realpath(step) != os.path.join(os.path.realpath(root), name)
    ):
        raise UnsafeCheckpointError(
            f"{root / 'latest'} names {name[:200]!r}, not a step-NNNNNNNN directory inside {root}: refused. regen's "
            "trainer writes only such names; write the newest step directory's name there, or delete the file"
        )
    return step


def latest_path(out_dir: str | Path) -> Path | None:
    step = latest_step(Path(out_dir) / "checkpoints")
    if step is None:
        return None
    path = step / "state.pt"
    return path if path.exists() else None


def _pointer(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


def mark_best(out_dir: str | Path, name: str) -> None:
    """Point OUT/checkpoints/best at step directory `name` (written the way `latest` is: atomically)."""
    root = Path(out_dir) / "checkpoints"
    tmp = root / f".best-{uuid.uuid4().hex[:8]}"
    tmp.write_text(name + "\n")
    os.replace(tmp, root / "best")
    _fsync_dir(root)


def best_path(out_dir: str | Path) -> Path | None:
    """state.pt of the best checkpoint by held-out accept length, if one was marked and is still there."""
    root = Path(out_dir) / "checkpoints"
    name = _pointer(root / "best")
    if name is None or not name.startswith("step-") or "/" in name:
        return None
    path = root / name / "state.pt"
    return path if path.exists() else None


class UnsafeCheckpointError(ConfigError):
    """A state.pt that holds more than tensors and plain data (a pickle that would run code)."""


def load_checkpoint(path: str | Path, map_location="cpu", *, mmap: bool = False) -> dict:
    """The state dict in `path`, loaded without running any code it may carry."""
    if not zipfile.is_zipfile(path):  # torch.save's format; a bare pickle is never ours
        raise UnsafeCheckpointError(
            f"{path}: refused to load: not a checkpoint torch.save wrote (no zip container). regen's "
            "trainer never writes such a file; delete it (or the step directory) if you did not put it there"
        )
    try:
        # TorchVersion (a str subclass) is the one non-plain type older checkpoints hold.
        with torch.serialization.safe_globals([TorchVersion]):
            state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{path}: refused to load: it holds objects other than tensors and plain data, so loading "
            f"it could run code ({str(e).splitlines()[0]}). regen's trainer never writes such a file; "
            "delete it (or the step directory) if you did not put it there"
        ) from None
    if not isinstance(state, dict):
        raise UnsafeCheckpointError(f"{path}: not a regen checkpoint (a {type(state).__name__}, not a dict)")
    return state


def load_latest(out_dir: str | Path, map_location="cpu") -> dict | None:
    path = latest_path(out_dir)
    return None if path is None else load_checkpoint(path, map_location)
