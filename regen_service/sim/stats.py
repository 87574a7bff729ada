"""Live statistics of the simulator, and their two outward forms: `/sim/stats` JSON and `/metrics` text.

The scheduler reports load changes (running, queued) and generated tokens; the routes report request
outcomes and injected faults. Mean running is time-weighted from the first request after start or
reset, so a client's saturation can be read as mean_running / max_running_requests. This module does
not decide anything; it only counts.
"""

from __future__ import annotations

import time
from bisect import bisect_left

LATENCY_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, float("inf"))
THROUGHPUT_WINDOW_S = 2.0

_COUNTERS = (
    "requests_total",
    "completed",
    "tokens_generated",
    "prompt_tokens",
    "num_503",
    "num_context_errors",
    "num_disconnects_injected",
    "num_stalls_injected",
    "num_error_events_injected",
    "num_aborts_injected",
    "num_client_disconnects",
    "images_total",  # images in requests the simulator took (each decoded and counted as tokens)
    "num_bad_images",  # requests refused with 400 for an image that cannot be read
)


class Stats:
    def __init__(self) -> None:
        self.running = 0
        self.queued = 0
        self.last_gen_throughput = 0.0
        # speculative decoding: totals over finished requests, never reset (like SGLang's own average)
        self.spec_tokens = 0
        self.spec_verify_ct = 0
        self._tp_mark = (time.monotonic(), 0)
        self.reset()

    def reset(self) -> None:
        for name in _COUNTERS:
            setattr(self, name, 0)
        self.peak_running = self.running
        self.peak_queued = self.queued
        self._t0: float | None = time.monotonic() if self.running or self.queued else None
        self._t_last = self._t0
        self._area = 0.0
        self._busy_s = 0.0
        self._latency_counts = [0] * len(LATENCY_BUCKETS_S)
        self._latency_sum = 0.0

    def _integrate(self, now: float) -> None:
        if self._t_last is None:
            return
        dt = now - self._t_last
        self._area += self.running * dt
        if self.running:
            self._busy_s += dt
        self._t_last = now

    def set_load(self, running: int, queued: int) -> None:
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = self._t_last = now
        self._integrate(now)
        self.running, self.queued = running, queued
        self.peak_running = max(self.peak_running, running)
        self.peak_queued = max(self.peak_queued, queued)

    def started(self, prompt_tokens: int) -> None:
        if self._t0 is None:
            self._t0 = self._t_last = time.monotonic()
        self.requests_total += 1
        self.prompt_tokens += prompt_tokens

    def images(self, n: int) -> None:
        self.images_total += n

    def add_tokens(self, n: int) -> None:
        self.tokens_generated += n

    def finished(self, e2e_s: float, completion_tokens: int, spec_verify_ct: int) -> None:
        self.completed += 1
        self._latency_counts[bisect_left(LATENCY_BUCKETS_S, e2e_s)] += 1
        self._latency_sum += e2e_s
        if spec_verify_ct:
            self.spec_tokens += completion_tokens
            self.spec_verify_ct += spec_verify_ct

    def sample_throughput(self) -> None:
        """Called every second or so: last_gen_throughput over the last window."""
        now = time.monotonic()
        t, tokens = self._tp_mark
        if now - t >= THROUGHPUT_WINDOW_S:
            # a reset in between makes the difference negative: report 0 for that window
            self.last_gen_throughput = max(0, self.tokens_generated - tokens) / (now - t)
            self._tp_mark = (now, self.tokens_generated)

    @property
    def avg_spec_accept_length(self) -> float | None:
        return self.spec_tokens / self.spec_verify_ct if self.spec_verify_ct else None

    def snapshot(self, capacity_tok_s: float, max_running: int) -> dict:
        now = time.monotonic()
        self._integrate(now)
        elapsed = (now - self._t0) if self._t0 is not None else 0.0
        mean_running = self._area / elapsed if elapsed > 0 else 0.0
        out = {name: getattr(self, name) for name in _COUNTERS}
        out |= {
            "capacity_tok_s": round(capacity_tok_s, 3),
            "max_running_requests": max_running,
            "running": self.running,
            "queued": self.queued,
            "peak_running": self.peak_running,
            "peak_queued": self.peak_queued,
            "mean_running": round(mean_running, 4),
            "utilization": round(mean_running / max_running, 4),
            "busy_s": round(self._busy_s, 3),
            "elapsed_s": round(elapsed, 3),
            "mean_gen_tok_s": round(self.tokens_generated / elapsed, 3) if elapsed > 0 else 0.0,
            "last_gen_throughput": round(self.last_gen_throughput, 3),
            "avg_spec_accept_length": self.avg_spec_accept_length,
        }
        return out

    def prometheus(self, model: str) -> str:
        """Prometheus text exposition with SGLang's metric names."""
        lab = f'{{model_name="{model}"}}'
        lines: list[str] = []

        def metric(name: str, kind: str, value: float, help_: str) -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name}{lab} {float(value)}"])

        metric("sglang:gen_throughput", "gauge", self.last_gen_throughput, "Generation throughput (token/s).")
        metric("sglang:num_running_reqs", "gauge", self.running, "The number of running requests.")
        metric("sglang:num_queue_reqs", "gauge", self.queued, "The number of requests in the waiting queue.")
        metric(
            "sglang:spec_accept_length", "gauge", self.avg_spec_accept_length or 0.0, "Average accept length."
        )
        metric("sglang:generation_tokens_total", "counter", self.tokens_generated, "Generation tokens.")
        metric("sglang:prompt_tokens_total", "counter", self.prompt_tokens, "Prefill tokens.")
        metric("sglang:num_requests_total", "counter", self.requests_total, "Requests received.")
        name = "sglang:e2e_request_latency_seconds"
        lines += [f"# HELP {name} End-to-end request latency.", f"# TYPE {name} histogram"]
        cum = 0
        for bound, count in zip(LATENCY_BUCKETS_S, self._latency_counts, strict=True):
            cum += count
            le = "+Inf" if bound == float("inf") else str(float(bound))
            lines.append(f'{name}_bucket{{model_name="{model}",le="{le}"}} {float(cum)}')
        lines += [f"{name}_sum{lab} {self._latency_sum}", f"{name}_count{lab} {float(cum)}"]
        return "\n".join(lines) + "\n"
