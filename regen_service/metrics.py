"""Worker-level Prometheus metrics (rows and shards); the endpoint client keeps its own in client/metrics.py.

`regen worker --metrics-port P` serves the default registry, which holds both.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

ROWS_FINISHED = Counter(
    "regen_rows_finished_total",
    "Prompts finished by this worker, by outcome (answered, reused, passthrough, error class)",
    ["outcome"],
)
ROW_TOKENS = Counter("regen_row_completion_tokens_total", "Completion tokens in finished rows")
SHARDS_FINISHED = Counter("regen_shards_finished_total", "Output shards this worker wrote")
SHARDS_IN_PROGRESS = Gauge("regen_shards_in_progress", "Shards this worker holds right now")


def row_outcome(row: dict) -> str:
    if row.get("error_class"):
        return row["error_class"]
    if row.get("reused_from"):
        return "reused"
    return "passthrough" if not row.get("turns") else "answered"


def count_row(row: dict) -> None:
    ROWS_FINISHED.labels(row_outcome(row)).inc()
    ROW_TOKENS.inc(row.get("completion_tokens") or 0)
