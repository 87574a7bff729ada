"""Which package may import which, read from the source with `ast` (nothing is imported to check it).

schemas/ is the data contract every side reads: it depends on no client, framework or regen module.
Entry points (workers/, regen_service/cli/) sit on top of the library: the library imports neither, so
it can be used without them; a command line written as a string (localproc) is no import. The stages
import along the flow only: state (storage, ledger, queue) under everything, produce on state, work on
produce and state, train on state; the simulator stands alone (it is the GPU server's stand-in).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS_MAY_NOT = ("celery", "httpx", "torch", "redis", "regen_service")


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every module the file imports, anywhere in it (function bodies too), relative imports resolved;
    `from a import b` counts as both a and a.b, since b may be a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _is_within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _files(folder: str) -> list[Path]:
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, f"no Python files under {ROOT / folder}"
    return files


@pytest.mark.parametrize("path", _files("schemas"), ids=lambda p: str(p.relative_to(ROOT)))
def test_schemas_depend_on_no_client_framework_or_regen_module(path):
    bad = sorted(m for m in imported_modules(path) if any(_is_within(m, p) for p in SCHEMAS_MAY_NOT))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_library_imports_no_entry_point():
    cli = ROOT / "regen_service" / "cli"
    bad = []
    for path in _files("regen_service"):
        for module in imported_modules(path):
            in_cli = cli in path.parents
            if _is_within(module, "workers") or (not in_cli and _is_within(module, "regen_service.cli")):
                bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, "\n".join(bad)


# stage -> the stages it may not import (the flow: state <- produce <- work; state <- train; sim alone)
STAGE_MAY_NOT = {
    "state": ("produce", "work", "train", "deploy", "sim", "cli"),
    "produce": ("work", "train", "deploy", "sim", "cli"),
    "work": ("train", "deploy", "sim", "cli"),
    "train": ("produce", "work", "deploy", "sim", "cli"),
    "sim": ("produce", "work", "state", "train", "deploy", "cli"),
    "deploy": ("produce", "state", "sim", "cli"),
}


@pytest.mark.parametrize("stage", sorted(STAGE_MAY_NOT))
def test_stages_import_along_the_flow(stage):
    bad = []
    for path in _files(f"regen_service/{stage}"):
        for module in imported_modules(path):
            for other in STAGE_MAY_NOT[stage]:
                if _is_within(module, f"regen_service.{other}"):
                    bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_relative_and_nested_imports(tmp_path):
    pkg = tmp_path / "regen_service" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "mod.py").write_text("def f():\n    from ..cli import base\n    import workers.celery_app\n")
    found = imported_modules(pkg / "mod.py", root=tmp_path)
    assert {"regen_service.cli", "regen_service.cli.base", "workers.celery_app"} <= found
