"""regen's whole training step beside SpecForge's and speculators' on one GPU, in one command.

    python3 scripts/bench_train_peers.py --specforge SF --speculators SP \
        [--plan 'llama-3.1-8b:2048;kimi:2048,8192,16384'] [--steps 8] [--deadline-s 560] [--out results.jsonl]

SF / SP: checkouts (or `git archive` trees) of sgl-project/SpecForge and vllm-project/speculators;
--peer-pythonpath: where speculators' pydantic is, on a bare GPU image (wheels installed with
--target). The peer benchmark is ../shared/bench-peers/bench_peers.py (--bench-peers). Per shapes group
one regen process measures every length with --step whole and --step draft; each peer runs a process
per length. JSON lines on stdout (and --out): every measurement, then one `compare` row per (shapes,
length) with MFU by the whole-step formula for everyone and regen's ratio to the best peer. The work is
regen_service/bench/peers_run.py's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from regen_service.bench import peers_run  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", default="llama-3.1-8b:2048;kimi:2048,8192,16384")
    p.add_argument("--specforge", type=Path, default=None)
    p.add_argument("--speculators", type=Path, default=None)
    p.add_argument(
        "--bench-peers", type=Path, default=ROOT.parent / "shared" / "bench-peers" / "bench_peers.py"
    )
    p.add_argument("--peer-pythonpath", default="")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--deadline-s", type=float, default=560)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    try:
        plan = peers_run.parse_plan(a.plan)
        peers = None
        if a.specforge or a.speculators:
            peers = peers_run.layout(
                Path(tempfile.mkdtemp(prefix="peers-")), a.bench_peers, a.specforge, a.speculators
            )
    except (ValueError, FileNotFoundError) as e:
        print(f"bench_train_peers: {e}", file=sys.stderr)
        return 2
    lines = []
    sink = a.out.open("a") if a.out else None

    def emit(rec: dict) -> None:
        lines.append(rec)
        text = json.dumps(rec)
        print(text, flush=True)
        if sink:
            sink.write(text + "\n")
            sink.flush()

    peers_run.run_all(peers_run.commands(plan, ROOT, peers, a.steps, a.peer_pythonpath), a.deadline_s, emit)
    for row in peers_run.compare(lines):
        emit({"compare": True, **row})
    return 0


if __name__ == "__main__":
    sys.exit(main())
