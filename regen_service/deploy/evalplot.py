"""The eval-draft chart: accept length per source as horizontal bars, the overall mean as a line.

One panel per sampling temperature, sources top to bottom in the report's order, each bar labelled with
its accept length and number of prompts. matplotlib (the `eval` extra) is imported here only, with the
Agg backend (no display): a host without it gets MissingPlotLibrary and the table and JSON still print.
The figures come from evaldraft.EvalReport; this module computes nothing.
"""

from __future__ import annotations

from pathlib import Path

from regen_service.deploy.evaldraft import EvalReport
from regen_service.errors import ConfigError


class MissingPlotLibrary(ConfigError):
    """matplotlib is not installed: the chart is skipped, the rest of the report stands."""


def plot_report(report: EvalReport, path: str | Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingPlotLibrary(
            "no chart: matplotlib is not installed; `pip install 'regen[eval]'` (or matplotlib) for the PNG"
        ) from None
    sources = [s.source for s in report.modes[0].sources]
    n = len(report.modes)
    fig, axes = plt.subplots(
        1, n, figsize=(6.5 * n, 1.6 + 0.55 * len(sources)), sharey=True, squeeze=False, dpi=100
    )
    top = max([s.accept_length or 1.0 for m in report.modes for s in [*m.sources, m.overall]] + [1.0])
    for ax, mode in zip(axes[0], report.modes, strict=True):
        mean = mode.overall.accept_length
        if mean is not None:  # drawn first: the bar labels sit on top of it
            ax.axvline(mean, color="#c44e52", linestyle="--", linewidth=1.5, zorder=1)
            ax.text(mean, 1.01, f"overall {mean:.2f}", color="#c44e52", ha="center", va="bottom",
                    fontsize=9, transform=ax.get_xaxis_transform())  # fmt: skip
        values = [s.accept_length or 0.0 for s in mode.sources]
        ax.barh(range(len(values)), values, color="#4c72b0", height=0.6, zorder=2)
        for y, s in enumerate(mode.sources):
            label = f"{s.accept_length:.2f}" if s.accept_length is not None else "n/a"
            ax.text((s.accept_length or 0.0) + top * 0.01, y, f"{label}  (n={s.num_prompts})", va="center",
                    fontsize=9, zorder=3, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})  # fmt: skip
        ax.axvline(1.0, color="grey", linewidth=0.8, zorder=1)
        ax.set_xlim(0, top * 1.35)
        ax.set_xlabel("accept length (tokens per target forward pass)")
        kind = "greedy" if mode.temperature == 0 else f"sampled, T={mode.temperature:g}"
        ax.set_title(f"{kind}: {mode.overall.num_prompts} prompts", fontsize=10, pad=16)
        ax.grid(axis="x", alpha=0.3, zorder=0)
    axes[0][0].set_yticks(range(len(sources)), sources)
    axes[0][0].invert_yaxis()
    fig.suptitle(f"draft accept length per source ({report.engine}: {report.endpoint})", fontsize=11)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    plt.close(fig)
    return out
