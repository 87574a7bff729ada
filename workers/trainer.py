"""The long-lived trainer process: `python -m workers.trainer --run R --target T --out D [--follow]`.

Thin on purpose: it is `regen train` (regen_service.cli.train) with the same flags, started the
way process managers and torchrun expect a module (`torchrun --nproc_per_node 8 -m workers.trainer
-- --run R ...`). Everything it does lives in regen_service.train. It leaves through
regen_service.cli.process_exit: a finished rank must not abort in native teardown and fail the job.
"""

from __future__ import annotations

import sys

from regen_service.cli.process_exit import run_then_exit
from regen_service.cli.train import train_cmd


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    # torchrun's own parser takes `--run` for an abbreviation of its --run-path, so under torchrun the
    # trainer's flags follow a `--` (torchrun ... -m workers.trainer -- --run R ...); drop it here
    if args[:1] == ["--"]:
        args = args[1:]
    run_then_exit(train_cmd, args, "regen-trainer")


if __name__ == "__main__":
    main()
