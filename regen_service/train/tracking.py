"""Experiment trackers for the trainer's scalars: TensorBoard by default, wandb and mlflow on request.

`report_to` (train.yaml / `regen train --report-to`) picks them, as SpecForge (`--report-to`) and
speculators (`logger.py`: one handler per backend) do. Each is the library's own writer, nothing of ours:
TensorBoard's `torch.utils.tensorboard.SummaryWriter` (event files in OUT/tb; the `tensorboard`
package, in regen's train and dev extras), `wandb.init(...).log(..., step=)` (extra `regen[wandb]`),
`mlflow.start_run()` + `log_metrics(..., step=)` (extra `regen[mlflow]`). A tracker whose package is not
installed is one warning line saying what to install; training carries on with the others. Only rank 0
tracks. What the scalars are (names `train/...`, `eval/...`, `eval/source/<name>/...`) is loop.py's.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger(__name__)

_INSTALL = {
    "tensorboard": "pip install tensorboard (or regen[train])",
    "wandb": "pip install 'regen[wandb]'",
    "mlflow": "pip install 'regen[mlflow]'",
}


def tag(name: str) -> str:
    """A scalar name every tracker takes (mlflow allows letters, digits, _ - . / and spaces)."""
    return re.sub(r"[^A-Za-z0-9_./-]", "_", name)


class Trackers:
    def __init__(
        self, report_to: list[str], out_dir: Path, run_name: str, config: dict, enabled: bool = True
    ):
        self._writers: list[tuple[str, object]] = []
        names = [] if not enabled else [n for n in dict.fromkeys(report_to) if n != "none"]
        for name in names:
            try:
                self._writers.append((name, getattr(self, f"_open_{name}")(out_dir, run_name, config)))
            except ImportError:
                others = [n for n, _ in self._writers] + [n for n in names if n != name]
                log.warning(
                    "report_to %s: the %s package is not installed; %s (training goes on%s)",
                    name, name, _INSTALL[name], f" with {', '.join(dict.fromkeys(others))}" if others else "",
                )  # fmt: skip

    @property
    def active(self) -> list[str]:
        return [n for n, _ in self._writers]

    @staticmethod
    def _open_tensorboard(out_dir: Path, run_name: str, config: dict):
        import tensorboard  # noqa: F401  (SummaryWriter imports it lazily; fail here, once)
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(out_dir / "tb"))

    @staticmethod
    def _open_wandb(out_dir: Path, run_name: str, config: dict):
        import wandb

        return wandb.init(project="regen", name=run_name, dir=str(out_dir), config=config)

    @staticmethod
    def _open_mlflow(out_dir: Path, run_name: str, config: dict):
        import mlflow

        run = mlflow.start_run(run_name=run_name)
        mlflow.log_params({k: str(v)[:250] for k, v in config.items()})
        return run

    def log(self, scalars: dict[str, float | None], step: int) -> None:
        clean = {tag(k): float(v) for k, v in scalars.items() if isinstance(v, int | float)}
        for name, w in self._writers:
            if name == "tensorboard":
                for k, v in clean.items():
                    w.add_scalar(k, v, global_step=step)
            elif name == "wandb":
                w.log(clean, step=step)
            elif name == "mlflow":
                import mlflow

                mlflow.log_metrics(clean, step=step)

    def flush(self) -> None:
        for name, w in self._writers:
            if name == "tensorboard":
                w.flush()

    def close(self) -> None:
        for name, w in self._writers:
            if name == "tensorboard":
                w.close()
            elif name == "wandb":
                w.finish()
            elif name == "mlflow":
                import mlflow

                mlflow.end_run()
        self._writers = []


def eval_scalars(res: dict) -> dict[str, float | None]:
    """The tracker scalars of one evaluation: overall and per source."""
    out: dict[str, float | None] = {}

    def one(prefix: str, r: dict) -> None:
        out[f"{prefix}/loss"] = r["loss"]
        for j, (loss, acc) in enumerate(zip(r["loss_per_step"], r["acc"], strict=True)):
            out[f"{prefix}/loss_{j}"], out[f"{prefix}/acc_{j}"] = loss, acc
        for k, al in r["accept_length"].items():
            out[f"{prefix}/accept_length_k{k}"] = al

    one("eval", res)
    out["eval/target_entropy"], out["eval/oov_share"] = res["target_entropy"], res["oov_share"]
    out["eval/samples"] = res["samples"]
    for src, r in res.get("sources", {}).items():
        one(f"eval/source/{src}", r)
    return out
