"""Worker-level Prometheus metrics (rows and shards); the endpoint client keeps its own in client/metrics.py.

`regen worker --metrics-port P` serves the default registry, which holds both.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from schemas.rows import OutputRow

ROWS_FINISHED = Counter(
    "regen_rows_finished_total",
    "Prompts finished by this worker, by outcome (answered, reused, passthrough, error class)",
    ["outcome"],
)
ROW_TOKENS = Counter("regen_row_completion_tokens_total", "Completion tokens in finished rows")
SHARDS_FINISHED = Counter("regen_shards_finished_total", "Output shards this worker wrote")
SHARDS_IN_PROGRESS = Gauge("regen_shards_in_progress", "Shards this worker holds right now")


def row_outcome(row: OutputRow) -> str:
    if row.error_class:
        return row.error_class
    if row.reused_from:
        return "reused"
    return "passthrough" if not row.turns else "answered"


def count_row(row: OutputRow) -> None:
    ROWS_FINISHED.labels(row_outcome(row)).inc()
    ROW_TOKENS.inc(row.completion_tokens or 0)
