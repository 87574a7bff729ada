"""Build the small real target (a Llama-architecture code LM) on this machine and print its report as JSON.

    python3 scripts/build_small_target.py --out /tmp/small-target [--steps 2000] [--held-out sklearn,pandas,...]

The recipe and why its size were chosen are in regen_service/train/small_target.py and docs/quality.md;
the weights stay on the machine (never committed). A corpus too small for the steps asked, or a target
whose held-out perplexity stays above --max-perplexity, exits 2 with the reason.
"""

from __future__ import annotations

import argparse
import json
import site
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from regen_service.errors import ConfigError
from regen_service.train.small_target import TargetRecipe, build_target

HELD_OUT = "sklearn,pandas,sympy,networkx,statsmodels,matplotlib,skimage"


def main() -> int:
    d = TargetRecipe()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument(
        "--roots", default=None, help="comma-separated package roots (default: site-packages + stdlib)"
    )
    p.add_argument("--held-out", default=HELD_OUT)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--max-perplexity", type=float, default=d.max_perplexity)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    roots = (
        [Path(r) for r in a.roots.split(",")]
        if a.roots
        else [
            *(Path(x) for x in site.getsitepackages() if Path(x).is_dir()),
            Path(sysconfig.get_paths()["stdlib"]),
        ]
    )
    recipe = TargetRecipe(steps=a.steps, batch=a.batch, max_perplexity=a.max_perplexity)
    try:
        report = build_target(roots, set(a.held_out.split(",")), a.out, recipe, a.device)
    except ConfigError as e:
        print(f"build_small_target: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
