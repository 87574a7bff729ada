"""Accept length and tokens/s of a served draft per source: which data pays.

Against an endpoint serving the target with the draft (SGLang or vLLM, spec_client.py), the prompts of
each source are sent as one batch, sources one after another, once per sampling temperature (greedy and
sampled). A source's accept length comes from the engine over exactly that source's requests: on vLLM
`1 + Δaccepted / Δdrafts` of its spec-decode counters read before and after the source's batch (so the
endpoint must serve nothing else meanwhile); on SGLang the requests' own `meta_info`, pooled
(Σ completion tokens / Σ spec_verify_ct, the same ratio a counter gives). Overall figures pool the
sources. With a baseline endpoint (the target without a draft) each batch is repeated there for the
speed-up. An engine that reports no speculation is a ConfigError; a draft at ~1.0 is reported with
bench-spec's likely causes. Where the prompts come from (a run's held-out split, a file) is the CLI's;
the chart is evalplot.py's.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from regen_service.deploy.benchspec import COLLAPSED_ACCEPT_LENGTH, LIKELY_CAUSES
from regen_service.deploy.spec_client import (
    Prompt,
    engine_of,
    iter_prompts,
    open_client,
    request_accept_length,
    send,
    settled_vllm_counters,
)
from regen_service.errors import ConfigError

NO_DRAFT = {
    "vllm": "{url} (vLLM) serves no draft: {why}; start it with a draft (`regen launch-vllm --target DIR "
    '--draft DRAFT`, i.e. --speculative-config \'{{"method": "eagle3", ...}}\') and point --endpoint at it',
    "sglang": "{url} (SGLang) serves no draft: {why}; start it with `regen launch-sglang --draft DRAFT` "
    "(--speculative-algorithm EAGLE3) and point --endpoint at it",
}


class SourceResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str
    num_prompts: int
    failed: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    tok_s: float = 0.0
    accept_length: float | None = None
    drafts: float | None = None  # vLLM: growth of spec_decode_num_drafts over these requests
    accepted_tokens: float | None = None  # vLLM: growth of spec_decode_num_accepted_tokens
    verify_ct: int | None = None  # SGLang: Σ spec_verify_ct of these requests
    spec_tokens: int | None = None  # SGLang: Σ completion tokens of the requests that report verify_ct
    baseline_tok_s: float | None = None
    speedup: float | None = None


class ModeResult(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float
    sources: list[SourceResult]
    overall: SourceResult


class EvalReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    endpoint: str
    engine: str
    baseline: str | None = None
    max_new_tokens: int
    concurrency: int
    modes: list[ModeResult]
    missing_sources: list[str] = Field(default_factory=list)  # asked for, but no prompt to send
    heldout: dict | None = None  # {"run", "fraction", "seed"} when the prompts are a run's held-out split
    collapsed: bool = False
    diagnosis: list[str] = Field(default_factory=list)


def load_source_prompts(path: str | Path, source_field: str | None = None) -> dict[str, list[Prompt]]:
    """A JSONL prompts file grouped by source: `source_field`, else "source", else "category"."""
    fields = (source_field,) if source_field else ("source", "category")
    out: dict[str, list[Prompt]] = {}
    for n, p in iter_prompts(path):
        extra = p.model_extra or {}
        value = next((extra[f] for f in fields if extra.get(f) not in (None, "")), None)
        if value is None or not isinstance(value, str | int):
            named = f'"{source_field}"' if source_field else '"source" or "category"'
            raise ConfigError(
                f"{path}:{n}: no {named} field (a non-empty string); add one to every row naming its data "
                "source or category, or name the field that holds it with --source-field NAME"
            )
        out.setdefault(str(value), []).append(p)
    if not out:
        raise ConfigError(f"{path} holds no prompts; write one JSON object per line")
    return dict(sorted(out.items()))


async def _batch(
    client: httpx.AsyncClient, engine: str, prompts: list[Prompt], temperature: float, max_new_tokens: int,
    concurrency: int, source: str,
) -> SourceResult:  # fmt: skip
    sem = asyncio.Semaphore(concurrency)

    async def guarded(p: Prompt):
        async with sem:
            try:
                return await send(client, p, max_new_tokens, engine, temperature)
            except httpx.HTTPError as e:
                return e

    before = await settled_vllm_counters(client) if engine == "vllm" else None
    start = time.perf_counter()
    outcomes = await asyncio.gather(*(guarded(p) for p in prompts))
    wall = time.perf_counter() - start
    done = [o for o in outcomes if not isinstance(o, Exception)]
    tokens = sum(t for t, _ in done)
    r = SourceResult(
        source=source, num_prompts=len(prompts), failed=len(prompts) - len(done), output_tokens=tokens,
        wall_s=round(wall, 4), tok_s=round(tokens / wall, 2) if wall > 0 else 0.0,
    )  # fmt: skip
    if engine == "vllm":
        after = await settled_vllm_counters(client)
        if before is not None and after is not None:
            r.drafts, r.accepted_tokens = after[0] - before[0], after[1] - before[1]
    else:
        metas = [m for _, m in done]
        r.verify_ct = sum(int(m.get("spec_verify_ct") or 0) for m in metas)
        r.spec_tokens = sum(int(m.get("completion_tokens") or 0) for m in metas if m.get("spec_verify_ct"))
        if not r.verify_ct:  # builds that report only the per-request ratio
            accepts = [a for m in metas if (a := request_accept_length(m)) is not None]
            r.accept_length = round(sum(accepts) / len(accepts), 4) if accepts else None
    _set_accept(r)
    return r


def _set_accept(r: SourceResult) -> None:
    if r.drafts:
        r.accept_length = round(1 + r.accepted_tokens / r.drafts, 4)
    elif r.verify_ct:
        r.accept_length = round(r.spec_tokens / r.verify_ct, 4)


def _pool(sources: list[SourceResult], engine: str) -> SourceResult:
    total = SourceResult(source="overall", num_prompts=sum(s.num_prompts for s in sources))
    total.failed = sum(s.failed for s in sources)
    total.output_tokens = sum(s.output_tokens for s in sources)
    total.wall_s = round(sum(s.wall_s for s in sources), 4)
    total.tok_s = round(total.output_tokens / total.wall_s, 2) if total.wall_s > 0 else 0.0
    if engine == "vllm":
        total.drafts = sum(s.drafts or 0 for s in sources)
        total.accepted_tokens = sum(s.accepted_tokens or 0 for s in sources)
    else:
        total.verify_ct = sum(s.verify_ct or 0 for s in sources)
        total.spec_tokens = sum(s.spec_tokens or 0 for s in sources)
    _set_accept(total)
    if total.accept_length is None:  # SGLang builds with per-request ratios only: weight by prompts
        rated = [s for s in sources if s.accept_length is not None]
        n = sum(s.num_prompts for s in rated)
        total.accept_length = round(sum(s.accept_length * s.num_prompts for s in rated) / n, 4) if n else None
    return total


def _check_draft(url: str, engine: str, mode: ModeResult) -> None:
    o = mode.overall
    if o.output_tokens <= o.num_prompts:  # nothing long enough to draft for: no verdict
        return
    if engine == "vllm" and not o.drafts:
        why = "its vllm:spec_decode_* counters did not move over the requests"
        raise ConfigError(NO_DRAFT["vllm"].format(url=url, why=why))
    if engine == "sglang" and o.accept_length is None:
        why = "its responses carry no spec_verify_ct / spec_accept_length in meta_info"
        raise ConfigError(NO_DRAFT["sglang"].format(url=url, why=why))


async def evaluate(
    endpoint: str, prompts: dict[str, list[Prompt]], temperatures: list[float], *, baseline: str | None = None,
    max_new_tokens: int = 256, concurrency: int = 8, api_key: SecretStr | None = None, timeout_s: float = 600.0,
) -> EvalReport:  # fmt: skip
    """Measure every source at every temperature, sources one after another (see the module doc)."""
    if not prompts:
        raise ConfigError("no prompts to evaluate")
    async with open_client(endpoint, api_key, timeout_s, concurrency) as client:
        engine = await engine_of(client, endpoint)
        if engine == "vllm" and await settled_vllm_counters(client, tries=0) is None:
            why = "/metrics has no vllm:spec_decode_* counters"
            raise ConfigError(NO_DRAFT["vllm"].format(url=endpoint, why=why))
        base_client = open_client(baseline, api_key, timeout_s, concurrency) if baseline else None
        try:
            base_engine = await engine_of(base_client, baseline) if base_client else None
            first = next(iter(prompts.values()))[0]
            for c, e in ((client, engine), (base_client, base_engine)):  # warm-up, outside every batch
                if c is not None:
                    await _batch(c, e, [first], 0.0, 8, 1, "warm-up")
            modes = []
            for temp in temperatures:
                sources, base = [], []
                for source, batch in prompts.items():
                    args = (batch, temp, max_new_tokens, concurrency, source)
                    sources.append(await _batch(client, engine, *args))
                    if base_client is not None:
                        base.append(await _batch(base_client, base_engine, *args))
                mode = ModeResult(temperature=temp, sources=sources, overall=_pool(sources, engine))
                if base:
                    for r, b in zip([*sources, mode.overall], [*base, _pool(base, base_engine)], strict=True):
                        r.baseline_tok_s = b.tok_s
                        r.speedup = round(r.tok_s / b.tok_s, 3) if b.tok_s > 0 else None
                if mode.overall.failed == mode.overall.num_prompts:
                    raise ConfigError(
                        f"every request to {endpoint} failed; is the server up and serving the target?"
                    )
                _check_draft(endpoint, engine, mode)
                modes.append(mode)
        finally:
            if base_client is not None:
                await base_client.aclose()
    report = EvalReport(endpoint=endpoint, engine=engine, baseline=baseline, max_new_tokens=max_new_tokens,
                        concurrency=concurrency, modes=modes)  # fmt: skip
    value = modes[0].overall.accept_length
    if value is not None and value <= COLLAPSED_ACCEPT_LENGTH:
        report.collapsed, report.diagnosis = True, list(LIKELY_CAUSES)
    return report


def _mode_name(t: float) -> str:
    return "greedy (temperature 0)" if t == 0 else f"sampled (temperature {t:g})"


def format_table(report: EvalReport) -> str:
    lines = [f"eval-draft: {report.endpoint} ({report.engine}), max {report.max_new_tokens} new tokens, "
             f"concurrency {report.concurrency}"]  # fmt: skip
    width = max([len("overall")] + [len(s.source) for m in report.modes for s in m.sources])
    for m in report.modes:
        lines += ["", _mode_name(m.temperature),
                  f"{'source':<{width}}  {'prompts':>7}  {'accept':>6}  {'tok/s':>8}  {'base tok/s':>10}  {'speed-up':>8}"]  # fmt: skip
        for s in [*m.sources, m.overall]:
            acc = f"{s.accept_length:.2f}" if s.accept_length is not None else "-"
            base = f"{s.baseline_tok_s:.1f}" if s.baseline_tok_s else "-"
            up = f"{s.speedup:.2f}x" if s.speedup else "-"
            lines.append(f"{s.source:<{width}}  {s.num_prompts:>7}  {acc:>6}  {s.tok_s:>8.1f}  {base:>10}  {up:>8}"
                         + (f"  ({s.failed} failed)" if s.failed else ""))  # fmt: skip
    if report.missing_sources:
        lines.append(f"\nno prompts for: {', '.join(report.missing_sources)}")
    if report.collapsed:
        lines.append(
            f"\nTHE DRAFT ACCEPTS ~NOTHING (greedy accept length <= {COLLAPSED_ACCEPT_LENGTH}). "
            "Likely causes, most likely first:"
        )
        lines += [f"  {i}. {c}" for i, c in enumerate(report.diagnosis, 1)]
    return "\n".join(lines)
