"""Finding runs as an operator types them: whole ids, id prefixes, mix names, with near matches on a miss.

Every run is a folder under the data root (storage is the truth); the ledger knows the runs Redis still
holds, under this key prefix or under the demo's prefix for this data root (`regen demo` keeps its runs
apart so demos from two folders never meet). This module lists both and resolves a query to one run
and the Settings whose ledger holds it. Showing them is the CLI's.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass

from regen_service.errors import ConfigError
from regen_service.settings import Settings
from regen_service.state.ledger import Ledger
from regen_service.state.storage import RunLayout, Storage


def demo_settings(settings: Settings) -> Settings:
    """The key prefix `regen demo` uses for this data root."""
    import hashlib

    root_tag = hashlib.sha256(settings.data_root_resolved.encode()).hexdigest()[:6]
    return settings.model_copy(update={"key_prefix": f"{settings.key_prefix}-demo-{root_tag}"})


@dataclass
class RunRef:
    run_id: str
    name: str
    in_storage: bool
    settings: Settings | None  # whose ledger holds the run; None: no ledger does (Redis lost it)


def list_runs(settings: Settings) -> list[RunRef]:
    """Every run under the data root or in the ledgers (this prefix, then the demo's), by id."""
    refs: dict[str, RunRef] = {}
    storage = Storage(settings.data_root_resolved)
    try:
        stored = RunLayout.list_runs(storage)
    except FileNotFoundError:
        stored = []
    for rid in stored:
        layout = RunLayout(storage, rid)
        # A run exists once its manifest does (written last): a folder without one is an enqueue that
        # did not finish, which `resume` cannot rebuild either; enqueueing the mix again prepares it.
        if not storage.exists(layout.manifest_path):
            continue
        try:
            name = json.loads(storage.read_bytes(layout.manifest_path)).get("mix_name", "")
        except (ValueError, AttributeError, RecursionError):
            name = ""
        refs[rid] = RunRef(rid, str(name), True, None)
    for s in (settings, demo_settings(settings)):
        ledger = Ledger(s)
        for rid in ledger.run_ids():
            rec = ledger.run_record(rid) or {}
            ref = refs.setdefault(rid, RunRef(rid, rec.get("mix_name", ""), False, None))
            if ref.settings is None:
                ref.settings = s
    return sorted(refs.values(), key=lambda r: (r.name, r.run_id))


def resolve_run(settings: Settings, query: str) -> RunRef:
    """The one run whose id is `query`, starts with it, or whose mix name is (or starts with) it.

    Raises ConfigError listing the candidates when several match, or the nearest ids and names on a miss.
    """
    refs = list_runs(settings)
    for test in (
        lambda r: r.run_id == query,
        lambda r: r.run_id.startswith(query),
        lambda r: r.name == query,
        lambda r: r.name.startswith(query),
    ):
        found = [r for r in refs if test(r)]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            listed = ", ".join(f"{r.run_id} ({r.name})" for r in found[:10])
            raise ConfigError(f"{query!r} matches {len(found)} runs: {listed}; give more of the id")
    words = {r.run_id: r for r in refs} | {r.name: r for r in refs if r.name}
    near = difflib.get_close_matches(query, list(words), n=5, cutoff=0.5)
    hint = (
        "; near matches: " + ", ".join(f"{words[w].run_id} ({words[w].name})" for w in near) if near else ""
    )
    raise ConfigError(
        f"no run {query!r} under {settings.data_root_resolved}/runs or in the ledger{hint}. "
        "`regen runs` lists every run (check REGEN_DATA_ROOT and REGEN_KEY_PREFIX)"
    )
