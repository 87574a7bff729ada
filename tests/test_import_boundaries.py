"""Which package may import which, read from the source with `ast` (nothing is imported to check it).

schemas/ is the data contract every side reads: it depends on no client, framework or regen module.
Entry points (workers/, regen_service/cli/) sit on top of the library: the library imports neither, so
it can be used without them; a command line written as a string (localproc) is no import. The stages
import along the flow only: state (storage, ledger, queue) under everything, produce on state, work on
state only (the prompt shard's codec is schemas', beside the output rows'), train on state; the
simulator stands alone (it is the GPU server's stand-in). draft/ (the draft as files: its config, checkpoint, engine formats, export, validation) sits beside
state: it imports no stage, train and deploy import it, and deploy never imports train, so launching a
draft does not load the trainer. Inside the library no two modules import each other, directly or round
a loop, TYPE_CHECKING blocks and function bodies included (a cycle means one of them holds the other's
piece), and a nested package (work/client, produce/sources) imports nothing from the package around it.
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


def _files(folder: str, root: Path = ROOT) -> list[Path]:
    files = sorted((root / folder).rglob("*.py"))
    assert files, f"no Python files under {root / folder}"
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
# work reads prompt shards through schemas.prompt_rows, never produce.
# draft: the draft's files, beside state (imports no stage); train and deploy import it, deploy never train
STAGE_MAY_NOT = {
    "state": ("produce", "work", "train", "draft", "deploy", "sim", "cli"),
    "draft": ("produce", "work", "state", "train", "deploy", "sim", "cli"),
    "produce": ("work", "train", "draft", "deploy", "sim", "cli"),
    "work": ("produce", "train", "draft", "deploy", "sim", "cli"),
    "train": ("produce", "work", "deploy", "sim", "cli"),
    "sim": ("produce", "work", "state", "train", "draft", "deploy", "cli"),
    "deploy": ("produce", "state", "train", "sim", "cli"),
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


def _library_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the library modules it imports (regen_service, schemas, workers), itself left out."""
    paths = {
        _module_name(p, root): p for f in ("regen_service", "schemas", "workers") for p in _files(f, root)
    }
    return {m: {i for i in imported_modules(p, root) if i in paths and i != m} for m, p in paths.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_import_cycles_in_the_library():
    cycles = import_cycles(_library_graph())
    assert not cycles, "modules that import each other (move the shared piece down):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_nested_packages_import_nothing_from_the_package_around_them():
    bad = []
    for init in sorted((ROOT / "regen_service").glob("*/*/__init__.py")):
        nested = _module_name(init, ROOT)
        outer = nested.rsplit(".", 1)[0]
        for path in _files(str(init.parent.relative_to(ROOT))):
            for module in imported_modules(path):
                if _is_within(module, outer) and not _is_within(module, nested) and module != outer:
                    bad.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not bad, "\n".join(bad)


def test_draft_loads_without_torch_but_for_the_checkpoint():
    """Validating or launching a draft runs anywhere: only checkpoint.py imports torch at load time."""
    bad = []
    for path in _files("regen_service/draft"):
        if path.name == "checkpoint.py":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            bad += [f"{path.relative_to(ROOT)} imports {n}" for n in names if _is_within(n, "torch")]
    assert not bad, "\n".join(bad)


def test_the_cycle_finder_finds_a_loop_and_passes_a_chain():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_checker_sees_relative_and_nested_imports(tmp_path):
    pkg = tmp_path / "regen_service" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "mod.py").write_text("def f():\n    from ..cli import base\n    import workers.celery_app\n")
    found = imported_modules(pkg / "mod.py", root=tmp_path)
    assert {"regen_service.cli", "regen_service.cli.base", "workers.celery_app"} <= found
