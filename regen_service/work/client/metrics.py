"""Prometheus metrics of the endpoint client, registered once per process in the default registry.

Labels carry the redacted endpoint URL. Exposing them over HTTP (start_http_server) is the worker's
job; the pool and the endpoints only update them.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

PROMPTS_ANSWERED = Counter(
    "regen_client_requests_answered_total",
    "Requests answered by an endpoint (one per assistant turn)",
    ["endpoint"],
)
OUTPUT_TOKENS = Counter("regen_client_output_tokens_total", "Completion tokens received", ["endpoint"])
PROMPT_TOKENS = Counter("regen_client_prompt_tokens_total", "Prompt tokens sent", ["endpoint"])
INFLIGHT = Gauge("regen_client_inflight_requests", "Requests outstanding at the endpoint", ["endpoint"])
INFLIGHT_LIMIT = Gauge("regen_client_inflight_limit", "Per-endpoint in-flight limit", ["endpoint"])
ERRORS = Counter(
    "regen_client_errors_total",
    "Failed request attempts by class (retryable, terminal_row, terminal_endpoint, ...)",
    ["endpoint", "error_class"],
)
# 1 healthy, 0 ejected (being probed), -1 stopped for good (401, wrong model).
HEALTH = Gauge("regen_client_endpoint_health", "1 healthy, 0 ejected, -1 stopped", ["endpoint"])
TTFT = Histogram(
    "regen_client_ttft_seconds",
    "Time to first token",
    ["endpoint"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
)
RETRIES_EXHAUSTED = Counter("regen_client_retries_exhausted_total", "Requests that ran out of attempts")
# Answers in which a registered secret (the API key, quoted back by a server) was replaced by ***.
ANSWERS_SCRUBBED = Counter(
    "regen_client_answers_scrubbed_total", "Answers that quoted the API key (replaced by ***)", ["endpoint"]
)
