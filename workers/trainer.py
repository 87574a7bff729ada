"""The long-lived trainer process: `python -m workers.trainer --run R --target T --out D [--follow]`.

Thin on purpose: it is `regen train` (regen_service.cli.drafter) with the same flags, started the
way process managers and torchrun expect a module (`torchrun --nproc_per_node 8 -m workers.trainer
...`). Everything it does lives in regen_service.drafter.
"""

from __future__ import annotations

import sys

from regen_service.cli.drafter import train_cmd


def main(argv: list[str] | None = None) -> None:
    train_cmd.main(args=sys.argv[1:] if argv is None else argv, prog_name="regen-trainer")


if __name__ == "__main__":
    main()
