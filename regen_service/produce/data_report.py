"""What happened to each source of a run at enqueue: kept, quarantined and why, said out loud.

Rows that fail normalization never stop a run (they land in quarantine.parquet), so a source whose rows
all fail (a wrong `format`, a missing rename) would otherwise vanish quietly. This module summarizes
the manifest's per-source counts with the most common quarantine reasons, and names the sources an
operator must look at: one that keeps nothing, or quarantines more than a threshold. Printing and the
exit status are the CLI's (`regen enqueue --strict`).
"""

from __future__ import annotations

import re
from collections import Counter

from regen_service.state.storage import RunLayout
from schemas.records import RunManifest

DEFAULT_MAX_QUARANTINED_FRACTION = 0.10
_NUMBERS = re.compile(r"\d+")


def _reason_kind(reason: str) -> str:
    """Reasons that differ only in numbers (row lengths, indices) count as one."""
    return _NUMBERS.sub("N", reason)[:160]


def source_report(layout: RunLayout, manifest: RunManifest, num_reasons: int = 3) -> dict[str, dict]:
    """Per source: the manifest's counts, the quarantined fraction and the top reasons with counts."""
    reasons: dict[str, Counter] = {name: Counter() for name in manifest.sources}
    if layout.storage.exists(layout.quarantine_path):
        table = layout.storage.read_table(layout.quarantine_path).select(["source", "reason"])
        for src, reason in zip(table["source"].to_pylist(), table["reason"].to_pylist(), strict=True):
            reasons.setdefault(src, Counter())[_reason_kind(reason or "")] += 1
    out = {}
    for name, st in manifest.sources.items():
        out[name] = {
            **st.model_dump(),
            "quarantined_fraction": round(st.quarantined / st.read, 4) if st.read else 0.0,
            "top_reasons": [{"reason": r, "count": n} for r, n in reasons[name].most_common(num_reasons)],
        }
    return out


def source_warnings(
    report: dict[str, dict], max_quarantined_fraction: float = DEFAULT_MAX_QUARANTINED_FRACTION
) -> list[str]:
    """One sentence per source that needs a look, naming the source, the numbers and the first reason."""
    warnings = []
    for name, s in report.items():
        why = f" (most common: {s['top_reasons'][0]['reason']})" if s["top_reasons"] else ""
        if s["kept"] == 0:
            warnings.append(f"source {name!r} keeps nothing: {s['quarantined']} of {s['read']} rows quarantined"
                            f"{why}; check its `format` and `fields` in the mix")  # fmt: skip
        elif s["quarantined_fraction"] > max_quarantined_fraction:
            warnings.append(
                f"source {name!r} quarantines {s['quarantined']} of {s['read']} rows "
                f"({s['quarantined_fraction']:.0%} > {max_quarantined_fraction:.0%}){why}"
            )
    return warnings


def format_report(report: dict[str, dict]) -> str:
    """The enqueue table. Image columns (image parts kept, distinct images stored) appear only when
    some source has images, so a text-only run prints the table it always printed."""
    with_images = any(s.get("images") or s.get("images_stored") for s in report.values())
    img_head = f"{'images':>8}{'stored':>8}" if with_images else ""
    lines = [f"{'source':<24}{'read':>8}{'kept':>8}{'dup':>6}{'quarantined':>13}{img_head}  top reasons"]
    for name, s in report.items():
        top = "; ".join(f"{r['count']}x {r['reason']}" for r in s["top_reasons"]) or "-"
        imgs = f"{s.get('images', 0):>8}{s.get('images_stored', 0):>8}" if with_images else ""
        lines.append(
            f"{name:<24}{s['read']:>8}{s['kept']:>8}{s['duplicate']:>6}{s['quarantined']:>13}{imgs}  {top}"
        )
    return "\n".join(lines)
