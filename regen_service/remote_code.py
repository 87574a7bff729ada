"""Remote code as an explicit opt-in: which model folders need it, and loading their tokenizer.

Kimi-K2.5's folder maps its config and tokenizer to Python files inside the folder (`auto_map` in
config.json and tokenizer_config.json): loading it runs that code. regen never turns that on by
itself: the mix (`target.trust_remote_code: true`) or the trainer (`regen train
--trust-remote-code`) must say so. A folder that needs it without the opt-in is a ConfigError that
names the setting, raised before any request or training step. Only local folders are read (never
a download); what the tokenizer is then used for is the caller's.
"""

from __future__ import annotations

import json
from pathlib import Path

from regen_service.errors import ConfigError

_FILES = ("config.json", "tokenizer_config.json")


def remote_code_files(path: str | Path) -> list[str]:
    """The files of a local model folder whose `auto_map` points at code in the folder (none: [])."""
    root = Path(path)
    found = []
    for name in _FILES:
        f = root / name
        if not f.is_file():
            continue
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # not ours to judge here: loading it reports the problem
        if isinstance(data, dict) and data.get("auto_map"):
            found.append(name)
    return found


def require_opt_in(path: str | Path, trust_remote_code: bool, setting: str) -> None:
    """ConfigError when `path` needs remote code and `setting` did not allow it."""
    files = remote_code_files(path)
    if files and not trust_remote_code:
        raise ConfigError(
            f"{path} needs remote code: {' and '.join(files)} map classes to Python files in that folder "
            f"(auto_map), and loading it runs them. Set {setting} to allow it (only for a folder you "
            "trust), or point at a folder whose tokenizer loads without remote code"
        )


def load_tokenizer(path: str | Path, *, trust_remote_code: bool, setting: str):
    """AutoTokenizer from a local folder, remote code only with the opt-in (checked first)."""
    require_opt_in(path, trust_remote_code, setting)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as e:
        raise ConfigError(f"tokenizer {path}: cannot load it as a local tokenizer folder ({e})") from e
