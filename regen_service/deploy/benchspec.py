"""Measure what a speculative endpoint really buys: accept length, tokens/s, speed-up over a baseline.

Sends the same prompts to the speculative endpoint and (optionally) a baseline at each concurrency, on
SGLang or vLLM (found as the worker finds it, client/engines.py). On SGLang, `{"prompt": ...}` rows go to
native `/generate` (its meta_info carries `spec_verify_ct` and `spec_accept_length` per request) and the
server's `avg_spec_accept_length` comes from `internal_states[i]` of `/server_info` (older builds:
`/get_server_info`). On vLLM they go to `/v1/completions`, and the accept length of the run is
1 + accepted / drafts from the growth of `vllm:spec_decode_num_accepted_tokens_total` and
`vllm:spec_decode_num_drafts_total` on `/metrics` over the run (vLLM 0.32 `v1/spec_decode/metrics.py`).
`{"messages": [...]}` rows go to `/v1/chat/completions` on both (SGLang with `return_meta_info`). The
requests and the counter readers are spec_client.py's (shared with `regen eval-draft`). An accept length
near 1.0 means the draft contributes nothing: `diagnose` lists the likely causes. Output formatting is
the CLI's job.
"""

from __future__ import annotations

import asyncio
import time

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from regen_service.deploy.spec_client import (  # noqa: F401  (load_prompts, the accept readers: bench's API)
    Prompt,
    engine_of,
    fetch_server_accept,
    load_prompts,
    open_client,
    request_accept_length,
    send,
    server_accept_length,
    vllm_spec_counters,
)
from regen_service.errors import ConfigError

COLLAPSED_ACCEPT_LENGTH = 1.05
LIKELY_CAUSES = (
    "the server was started with `--speculative-algorithm EAGLE` (vLLM: method eagle) instead of `EAGLE3` "
    "(eagle3): the draft gets only the final hidden state and fc is skipped (launch it with "
    "`regen launch-sglang`, which refuses that)",
    "checkpoint keys the loader skipped, e.g. `layers.0.*` (speculators naming): the draft layer is random; "
    "run `regen validate-draft DIR --target-config TARGET` (and `regen convert-draft` to fix the names)",
    "missing `d2t`: draft ids are read as the first N target ids; `regen validate-draft` reports it",
    "auxiliary layers differ from training (eagle_aux_hidden_state_layer_ids vs the layers captured when "
    "the draft was trained; SGLang and vLLM read those ids differently): run `regen validate-draft DIR "
    "--engine sglang|vllm` and re-export with `regen export --engine` for the engine that serves it",
)


class RunResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    endpoint: str
    concurrency: int
    requests: int
    failed: int
    output_tokens: int
    wall_s: float
    tok_s: float
    accept_length: float | None = None  # completion tokens / verify passes over the requests that report them
    per_request_accept: list[float] = Field(default_factory=list)
    server_accept_length: float | None = None


class BenchReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    spec: list[RunResult]
    baseline: list[RunResult] = Field(default_factory=list)
    speedup: dict[int, float] = Field(default_factory=dict)
    accept_length: float | None = None
    collapsed: bool = False
    diagnosis: list[str] = Field(default_factory=list)


async def run_once(
    url: str,
    prompts: list[Prompt],
    concurrency: int,
    max_new_tokens: int,
    api_key: SecretStr | None,
    timeout_s: float,
) -> RunResult:
    async with open_client(url, api_key, timeout_s, concurrency) as client:
        engine = await engine_of(client, url)
        sem = asyncio.Semaphore(concurrency)

        async def guarded(p: Prompt):
            async with sem:
                try:
                    return await send(client, p, max_new_tokens, engine)
                except httpx.HTTPError as e:
                    return e

        before = await vllm_spec_counters(client) if engine == "vllm" else None
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(guarded(p) for p in prompts))
        wall = time.perf_counter() - start
        if engine == "vllm":
            after = await vllm_spec_counters(client)
            drafts = after[0] - before[0] if before and after else 0
            server_accept = round(1 + (after[1] - before[1]) / drafts, 4) if drafts else None
        else:
            server_accept = await fetch_server_accept(client)
    done = [o for o in outcomes if not isinstance(o, Exception)]
    if not done:
        raise ConfigError(f"every request to {url} failed (first: {outcomes[0]!r}); is the server up?")
    tokens = sum(t for t, _ in done)
    verify = sum(int(m.get("spec_verify_ct") or 0) for _, m in done if m.get("completion_tokens"))
    accepts = [a for _, m in done if (a := request_accept_length(m)) is not None]
    counted = sum(int(m.get("completion_tokens") or 0) for _, m in done if m.get("spec_verify_ct"))
    overall = counted / verify if verify else (sum(accepts) / len(accepts) if accepts else None)
    return RunResult(
        endpoint=url,
        concurrency=concurrency,
        requests=len(prompts),
        failed=len(prompts) - len(done),
        output_tokens=tokens,
        wall_s=round(wall, 4),
        tok_s=round(tokens / wall, 2) if wall > 0 else 0.0,
        accept_length=round(overall, 4) if overall is not None else None,
        per_request_accept=[round(a, 4) for a in accepts],
        server_accept_length=server_accept,
    )


def diagnose(report: BenchReport) -> None:
    """Set accept_length, collapsed and diagnosis from the spec runs (the server's figure wins)."""
    last = report.spec[-1]
    value = last.server_accept_length if last.server_accept_length is not None else last.accept_length
    report.accept_length = value
    if value is None:
        report.collapsed = True
        report.diagnosis = [
            "the endpoint reports no speculative metrics (SGLang: no spec_verify_ct in meta_info, no "
            "avg_spec_accept_length in /server_info; vLLM: no vllm:spec_decode_* counters on /metrics): is it "
            "running with a draft? Launch it with `regen launch-sglang --draft DIR` (SGLang) or with "
            '--speculative-config \'{"method": "eagle3", ...}\' (vLLM)'
        ]
    elif value <= COLLAPSED_ACCEPT_LENGTH:
        report.collapsed = True
        report.diagnosis = list(LIKELY_CAUSES)


async def bench(
    endpoint: str,
    prompts: list[Prompt],
    concurrencies: list[int],
    *,
    baseline: str | None = None,
    max_new_tokens: int = 256,
    api_key: SecretStr | None = None,
    timeout_s: float = 600.0,
) -> BenchReport:
    spec_runs, base_runs, speedup = [], [], {}
    for c in concurrencies:
        spec_runs.append(await run_once(endpoint, prompts, c, max_new_tokens, api_key, timeout_s))
        if baseline:
            base_runs.append(await run_once(baseline, prompts, c, max_new_tokens, api_key, timeout_s))
            if base_runs[-1].tok_s > 0:
                speedup[c] = round(spec_runs[-1].tok_s / base_runs[-1].tok_s, 3)
    report = BenchReport(spec=spec_runs, baseline=base_runs, speedup=speedup)
    diagnose(report)
    return report


def format_bench(report: BenchReport) -> str:
    lines = [f"{'concurrency':>11}  {'spec tok/s':>10}  {'base tok/s':>10}  {'speed-up':>8}  {'accept':>6}"]
    base = {r.concurrency: r for r in report.baseline}
    for r in report.spec:
        b = base.get(r.concurrency)
        lines.append(
            f"{r.concurrency:>11}  {r.tok_s:>10.1f}  {(f'{b.tok_s:.1f}' if b else '-'):>10}  "
            f"{(f'{report.speedup[r.concurrency]:.2f}x' if r.concurrency in report.speedup else '-'):>8}  "
            f"{(f'{r.accept_length:.2f}' if r.accept_length is not None else '-'):>6}"
            + (f"  ({r.failed} failed)" if r.failed else "")
        )
    server = report.spec[-1].server_accept_length
    lines.append(
        f"accept length: {report.accept_length if report.accept_length is not None else 'n/a'} "
        f"(server avg_spec_accept_length: {server if server is not None else 'n/a'})"
    )
    if report.collapsed:
        lines.append("SPECULATION IS NOT WORKING. Likely causes, most likely first:")
        lines += [f"  {i}. {c}" for i, c in enumerate(report.diagnosis, 1)]
    return "\n".join(lines)
