"""Files the vLLM target backend reads without the engine: the target's head weights from its safetensors
(a sharded multimodal checkpoint's names included), and a states file the engine wrote, read only inside
`target_states_dir` and only once its writer let go of the lock (vLLM's own `load_hidden_states`
protocol), then deleted. The requests themselves are engine_target.py's.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import time
from pathlib import Path

import torch

from regen_service.errors import ConfigError, RegenError


class EngineStateError(RegenError):
    """The engine did not deliver the hidden states of a sequence (down, misconfigured, file missing)."""


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index when the checkpoint is sharded."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    out: dict[str, Path] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update(dict.fromkeys(st.keys(), f))
    return out


def _pick(names: dict[str, Path], suffix: str, what: str, where: Path) -> str:
    # Multimodal targets (Kimi-K2.5) prefix the text model (`language_model.`); vision towers have
    # their own norms, so the shortest name with the suffix outside a vision tower is the text model's.
    found = sorted((n for n in names if n.endswith(suffix) and "vision" not in n), key=len)
    if not found:
        raise ConfigError(f"--target {where}: no tensor named *{suffix} ({what}) in its safetensors files")
    return found[0]


def load_head_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """embed_tokens, the final norm and lm_head of a local checkpoint, without loading the rest."""
    from safetensors import safe_open

    p = Path(path)
    names = _weight_files(p)
    if not names:
        raise ConfigError(f"--target {p}: no *.safetensors weights there (the trainer reads the embedding)")
    keys = {
        "embed": _pick(names, "embed_tokens.weight", "the input embedding", p),
        "norm": _pick(names, "model.norm.weight", "the final norm", p),
    }
    lm_head = [n for n in names if n.endswith("lm_head.weight")]
    keys["lm_head"] = min(lm_head, key=len) if lm_head else keys["embed"]  # tied embeddings
    out = {}
    for role, name in keys.items():
        with safe_open(str(names[name]), "pt") as st:
            out[role] = st.get_tensor(name)
    return out


STATES_KEYS = "hidden_states [T, layers, H] and token_ids [T], the safetensors file vllm_connector.py writes"


def confined(path: object, states_dir: str | Path) -> Path:
    """The engine's `hidden_states_path` resolved (symlinks followed), refused unless it is a
    .safetensors file inside `states_dir`: the reply is the engine's word, and the trainer deletes
    what it reads, so a path elsewhere (another run's states, a model's weights) is never touched."""
    root = Path(os.path.realpath(states_dir))
    if not isinstance(path, str) or not path or "\x00" in path:
        raise EngineStateError(f"the engine's hidden_states_path {path!r} is not a file path")
    real = Path(os.path.realpath(root / path))  # an absolute `path` replaces root in the join
    if root not in real.parents or real.suffix != ".safetensors":
        raise EngineStateError(
            f"the engine's hidden_states_path {path!r} is not a .safetensors file inside target_states_dir "
            f"{root}: refused, nothing read or deleted. Set target_states_dir to the folder the engine was "
            "started with (`regen launch-vllm --hidden-states DIR`)"
        )
    return real


def _wait_for_writer(lock: Path, path: str, timeout_s: float) -> int:
    """A shared flock on the engine's lock file, polled until `timeout_s`: a writer that never lets go
    (or another process holding the lock) is an error, not a trainer hung for good."""
    try:
        # O_NONBLOCK: a FIFO planted as the lock must not block the open itself
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise EngineStateError(
            f"the engine wrote hidden states to {path}, which this trainer cannot read (no {lock.name}): run "
            "the trainer on the engine's host, or set the engine's shared_storage_path to a shared filesystem"
        ) from None
    except OSError as e:
        raise EngineStateError(f"{lock}: cannot open the engine's lock file ({e.strerror})") from None
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise EngineStateError(
                    f"{lock} is still locked after {timeout_s:g} s (target_request_timeout_s): the engine "
                    f"is stuck writing {path}, or another process holds the lock; restart the engine, or "
                    "remove the lock file if no engine writes there"
                ) from None
            time.sleep(0.01)


def read_state_file(path: str, states_dir: str | Path, timeout_s: float = 600.0) -> dict[str, torch.Tensor]:
    """The engine's file, once its writer released the lock (vLLM's own `load_hidden_states` protocol),
    read only inside `states_dir` and deleted (with its lock) once read."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    real = confined(path, states_dir)
    lock = Path(os.path.realpath(str(real) + ".lock"))
    if lock != real.with_name(real.name + ".lock"):  # a symlink: its target may lie anywhere
        raise EngineStateError(f"{real}.lock is a link to {lock}: refused, nothing read or deleted")
    fd = _wait_for_writer(lock, path, timeout_s)
    try:
        if not stat.S_ISREG(os.stat(real, follow_symlinks=False).st_mode):
            raise EngineStateError(f"{path} is not a regular file; expected {STATES_KEYS}")
        data = load_file(str(real), device="cpu")
    except FileNotFoundError:
        raise EngineStateError(
            f"the engine wrote hidden states to {path}, which this trainer cannot read (no such file): run "
            "the trainer on the engine's host, or set the engine's shared_storage_path to a shared filesystem"
        ) from None
    except (SafetensorError, OSError, ValueError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise EngineStateError(f"{path} is not a states file ({why}); expected {STATES_KEYS}") from None
    finally:
        os.close(fd)
    hs, ids = data.get("hidden_states"), data.get("token_ids")
    if hs is None or ids is None or hs.ndim != 3 or ids.ndim != 1 or hs.shape[0] != ids.shape[0]:
        got = {k: list(v.shape) for k, v in data.items()}
        raise EngineStateError(f"{path} holds {got}; expected {STATES_KEYS}")
    for f in (real, lock):
        with contextlib.suppress(FileNotFoundError):
            os.remove(f)
    return data
