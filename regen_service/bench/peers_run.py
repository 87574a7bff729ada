"""regen's training step beside SpecForge's and speculators', one device call: plan, lay out, run, compare.

`layout` puts the shared peer benchmark (../shared/bench-peers/bench_peers.py, which imports SpecForge
from `sf/` and speculators from `spec/src` beside itself) in a folder with links to the peers'
checkouts, as that folder's assemble.sh does, but against this checkout's own regen (assemble.sh copies
an older subset of regen's packages). `commands` lists the processes, in order: per shapes group one
regen process measuring every length, `--step whole` and `--step draft` (bench_train.py --mode draft
takes lists: the start and compiles are paid once), then per length SpecForge (flex_attention) and
speculators, each a process of its own. `run_all` runs them under a deadline (a process that cannot
finish in the time left is skipped, not started) and `compare` turns the lines into one row per
(shapes, length): tokens/s, MFU under the whole-step formula for everyone (train_flops.peer_step_figures
recounts the peers' lines), peak memory, regen's ratio to the best peer, the process's age at its first
timed step. Plain Python: the processes import torch, this module does not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from regen_service.bench.train_flops import LLAMA_8B_SHAPES, peer_step_figures

# bench_peers.py's P3_SHAPES for each of bench_train.py's --shapes: Kimi-K2.5's draft at 64 x 112 heads
# for the peers (the target's split; regen serves 56 x 128, the same FLOPs)
PEER_SHAPES = {"llama-3.1-8b": LLAMA_8B_SHAPES, "kimi": "7168,64,64,18432,163840,32000",
               "tiny": "256,4,2,512,4096,1024"}  # fmt: skip
SPECULATORS_STUB = "speculators-0.0.0+stub.dist-info"


@dataclass
class Proc:
    name: str
    argv: list[str]
    env: dict = field(default_factory=dict)
    cap_s: int = 300
    tags: dict = field(default_factory=dict)


def parse_plan(text: str) -> list[tuple[str, list[int]]]:
    """ "llama-3.1-8b:2048;kimi:2048,8192,16384" -> [(shapes, [lengths])]; shapes as bench_train.py's."""
    plan = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        shapes, _, seqs = part.partition(":")
        if shapes not in PEER_SHAPES or not seqs:
            raise ValueError(
                f"--plan {part!r}: want SHAPES:LEN[,LEN...] with SHAPES one of {sorted(PEER_SHAPES)}"
            )
        plan.append((shapes, [int(s) for s in seqs.split(",")]))
    if not plan:
        raise ValueError("--plan is empty: e.g. 'llama-3.1-8b:2048;kimi:2048,8192,16384'")
    return plan


def layout(dest: Path, bench_peers: Path, specforge: Path | None, speculators: Path | None) -> Path:
    """dest/{bench_peers.py, sf/specforge, spec/src/speculators, spec/stub/<dist-info>}: links, no copies."""
    if not bench_peers.is_file():
        raise FileNotFoundError(f"{bench_peers}: the shared peer benchmark (bench_peers.py) is not there")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "bench_peers.py").write_bytes(bench_peers.read_bytes())
    links = {}
    if specforge is not None:
        links[dest / "sf" / "specforge"] = _package(specforge, "specforge", "modeling")
    if speculators is not None:
        links[dest / "spec" / "src" / "speculators"] = _package(speculators, "speculators", "models")
        stub = dest / "spec" / "stub" / SPECULATORS_STUB
        stub.mkdir(parents=True, exist_ok=True)
        (stub / "METADATA").write_text("Metadata-Version: 2.1\nName: speculators\nVersion: 0.0.0+stub\n")
    for link, target in links.items():
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target.resolve(), target_is_directory=True)
    return dest


def _package(root: Path, name: str, inner: str) -> Path:
    """The package folder `name` under a checkout (root/name or root/src/name), holding `inner`."""
    for cand in (root / name, root / "src" / name, root):
        if (cand / inner).is_dir() and cand.name == name:
            return cand
    raise FileNotFoundError(f"{root}: no {name}/ package (with {inner}/) in it or in {root / 'src'}")


def commands(plan, repo: Path, peers_dir: Path | None, steps: int, peer_pythonpath: str = "") -> list[Proc]:
    procs = []
    for shapes, seqs in plan:
        argv = [sys.executable, str(repo / "scripts" / "bench_train.py"), "--mode", "draft", "--shapes", shapes,
                "--seq", ",".join(map(str, seqs)), "--step", "whole,draft", "--steps", str(steps)]  # fmt: skip
        # the repo first, then what the caller's PYTHONPATH holds (optional kernels such as flash-attn-4
        # carried to a bare GPU host)
        path = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH", "")]))
        procs.append(
            Proc(f"regen-{shapes}", argv, {"PYTHONPATH": path}, 120 + 90 * len(seqs), {"shapes": shapes})
        )
        if peers_dir is None:
            continue
        for t in seqs:
            base = [sys.executable, str(peers_dir / "bench_peers.py"), "--seq", str(t), "--max-pos", str(t),
                    "--steps", str(steps)]  # fmt: skip
            env = {"P3_SHAPES": PEER_SHAPES[shapes]}
            # SpecForge compiles flex attention for the length before its first step: at 16K that alone
            # passed 177 s on an H200 (2026-12-02), so long sequences get a longer cap
            cap = 240 if t <= 8192 else 480
            # seq and impl ride on a failed or skipped process's line too, so `compare` can say who is missing
            tags = {"shapes": shapes, "seq": t}
            if (peers_dir / "sf" / "specforge").exists():
                argv = [*base, "--impl", "specforge", "--backend", "flex_attention"]
                procs.append(Proc(f"specforge-{shapes}-{t}", argv, env, cap, tags | {"impl": "specforge"}))
            if (peers_dir / "spec" / "src" / "speculators").exists():
                pp = {"PYTHONPATH": peer_pythonpath} if peer_pythonpath else {}
                argv = [*base, "--impl", "speculators"]
                procs.append(
                    Proc(f"speculators-{shapes}-{t}", argv, env | pp, cap, tags | {"impl": "speculators"})
                )
    return procs


def run_all(procs: list[Proc], deadline_s: float, emit) -> None:
    """Each process in turn, capped at the time left; its JSON lines go to `emit`, tagged."""
    t0 = time.monotonic()
    for p in procs:
        left = deadline_s - (time.monotonic() - t0)
        if left < 30:
            emit({"run": p.name, **p.tags, "skipped": "deadline", "left_s": round(left, 1)})
            continue
        start = time.monotonic()
        try:
            out = subprocess.run(p.argv, env={**os.environ, **p.env}, capture_output=True, text=True,
                                 timeout=min(p.cap_s, left))  # fmt: skip
            rc, stdout, stderr = out.returncode, out.stdout, out.stderr
        except subprocess.TimeoutExpired as e:
            rc, stdout, stderr = "timeout", _text(e.stdout), _text(e.stderr)
        lines = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
        wall = round(time.monotonic() - start, 1)
        for line in lines:
            emit({"run": p.name, **p.tags, **line, "process_wall_s": wall})
        if rc != 0 or not lines:
            emit({"run": p.name, **p.tags, "rc": rc, "process_wall_s": wall, "stderr_tail": stderr[-1500:]})


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def compare(lines: list[dict]) -> list[dict]:
    """One row per (shapes, seq): regen whole/draft and each peer, MFU by the whole-step formula. A peer
    whose process failed, timed out or was skipped is listed in `peers_missing`, and regen's ratio is
    then `regen_whole_over_peers_that_ran`: never a "best peer" figure that leaves one out."""
    rows: dict[tuple, dict] = {}
    for x in lines:
        if "shapes" not in x or "seq" not in x:
            continue
        key = (x["shapes"], x["seq"])
        row = rows.setdefault(key, {"shapes": x["shapes"], "seq": x["seq"]})
        if "step_s" not in x:
            if x.get("impl") in ("specforge", "speculators") and ("rc" in x or "skipped" in x):
                why = x.get("skipped") or f"rc {x['rc']}"
                row.setdefault("peers_missing", []).append(f"{x['impl']} ({why})")
            continue
        if x.get("impl") in ("specforge", "speculators"):
            name = x["impl"]
            mfu = peer_step_figures(x, PEER_SHAPES[x["shapes"]])["mfu_vs_989"]
        else:
            name, mfu = f"regen_{x['step']}", x["mfu_vs_989"]
        row[name] = {"tokens_per_s": x["tokens_per_s"], "mfu_whole_formula": mfu, "peak_mem_gib": x.get("peak_mem_gib"),
                     **({"process_age_s": x["process_age_s"]} if "process_age_s" in x else {})}  # fmt: skip
    for row in rows.values():
        peers = [row[p]["tokens_per_s"] for p in ("specforge", "speculators") if p in row]
        if peers and "regen_whole" in row:
            name = (
                "regen_whole_over_peers_that_ran" if "peers_missing" in row else "regen_whole_over_best_peer"
            )
            row[name] = round(row["regen_whole"]["tokens_per_s"] / max(peers), 3)
    return list(rows.values())
