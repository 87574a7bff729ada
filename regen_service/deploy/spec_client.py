"""Talking to a speculative endpoint: which engine it is, one request, and the engine's own spec figures.

Shared by `regen bench-spec` (benchspec.py) and `regen eval-draft` (evaldraft.py), so both send the
same requests and read the same counters. The engine is found as the worker finds it
(work/client/engines.py). Per request, SGLang reports `spec_verify_ct` / `spec_accept_length` in the
`meta_info` of native `/generate`, and of `/v1/chat/completions` when the request sets
`return_meta_info` (SGLang `entrypoints/openai/serving_chat.py`: `choice_meta_info`, non-streaming). vLLM
reports nothing per request: its spec-decode counters on `/metrics`
(`vllm:spec_decode_num_drafts_total`, `vllm:spec_decode_num_accepted_tokens_total`, vLLM 0.32
`v1/spec_decode/metrics.py`) are read before and after a batch by the caller. What to make of the
figures (averages, verdicts, tables) is the callers' business.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
from pydantic import BaseModel, ConfigDict, SecretStr

from regen_service.errors import ConfigError, RegenError

VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


class Prompt(BaseModel):
    """One benchmark row: a raw `prompt` string or chat `messages` (other keys kept, e.g. a source)."""

    model_config = ConfigDict(extra="allow")

    prompt: str | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None


def iter_prompts(path: str | Path) -> Iterator[tuple[int, Prompt]]:
    """(line number, prompt) for every non-blank line of a JSONL file; a bad line is a ConfigError."""
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            p = Prompt.model_validate(json.loads(line))
        except (json.JSONDecodeError, ValueError) as e:
            raise ConfigError(f"{path}:{n}: not a JSON object ({e})") from None
        if (p.prompt is None) == (p.messages is None):
            raise ConfigError(f'{path}:{n}: give exactly one of "prompt" (a string) or "messages" (a list)')
        yield n, p


def load_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
    prompts = [p for _, p in iter_prompts(path)]
    if not prompts:
        raise ConfigError(f"{path} holds no prompts; write one JSON object per line")
    return prompts[:limit] if limit else prompts


def request_accept_length(meta: dict) -> float | None:
    """Accept length of one finished request: completion tokens / verify passes, else spec_accept_length."""
    verify = meta.get("spec_verify_ct")
    tokens = meta.get("completion_tokens")
    if verify and tokens:
        return float(tokens) / float(verify)
    value = meta.get("spec_accept_length")
    return float(value) if value is not None else None


def server_accept_length(info: dict) -> float | None:
    """Mean `avg_spec_accept_length` over `internal_states[]` (one per DP rank); never the top level."""
    values = [
        float(s["avg_spec_accept_length"])
        for s in info.get("internal_states") or []
        if isinstance(s, dict) and s.get("avg_spec_accept_length") is not None
    ]
    return sum(values) / len(values) if values else None


def prometheus_total(text: str, name: str) -> float | None:
    """The sum of a counter over all its label sets in Prometheus text format (None: not exported)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    return total if seen else None


async def vllm_spec_counters(client: httpx.AsyncClient) -> tuple[float, float] | None:
    """(drafts, accepted tokens) so far on a vLLM server, or None when it runs without a draft."""
    r = await client.get("/metrics")
    if r.status_code != 200:
        return None
    drafts, accepted = prometheus_total(r.text, VLLM_DRAFTS), prometheus_total(r.text, VLLM_ACCEPTED)
    return None if drafts is None or accepted is None else (drafts, accepted)


async def settled_vllm_counters(client: httpx.AsyncClient, tries: int = 10) -> tuple[float, float] | None:
    """The counters once two reads 50 ms apart agree: the last step's stats may land just after the
    last response, and a batch's figures must include them."""
    last = await vllm_spec_counters(client)
    for _ in range(tries):
        await asyncio.sleep(0.05)
        now = await vllm_spec_counters(client)
        if now == last:
            break
        last = now
    return last


async def detect_engine(client: httpx.AsyncClient, label: str) -> str:
    from regen_service.work.client.engines import engine_from

    async def body(path: str) -> bytes | None:
        r = await client.get(path)
        return r.content if r.status_code == 200 else None

    info = await body("/get_server_info") or await body("/server_info")
    if info is not None:
        return engine_from(info, None, None, label)
    return engine_from(None, await body("/version"), await body("/v1/models"), label)


def open_client(url: str, api_key: SecretStr | None, timeout_s: float, concurrency: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key.get_secret_value()}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 2)
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout_s, limits=limits)


async def engine_of(client: httpx.AsyncClient, url: str) -> str:
    """detect_engine with its failures as one-line ConfigErrors."""
    try:
        return await detect_engine(client, url)
    except httpx.HTTPError as e:
        raise ConfigError(f"{url} does not answer ({e}); is the server up?") from None
    except RegenError as e:
        raise ConfigError(str(e)) from None


async def send(
    client: httpx.AsyncClient, p: Prompt, max_new_tokens: int, engine: str, temperature: float = 0.0
) -> tuple[int, dict]:
    """Send one prompt; -> (completion tokens, the request's spec meta: {} on vLLM)."""
    if p.prompt is not None and engine == "vllm":
        body = {"prompt": p.prompt, "max_tokens": max_new_tokens, "temperature": temperature}
        r = await client.post("/v1/completions", json=body)
        r.raise_for_status()
        return int((r.json().get("usage") or {}).get("completion_tokens") or 0), {}
    if p.prompt is not None:
        params = {"max_new_tokens": max_new_tokens, "temperature": temperature}
        r = await client.post("/generate", json={"text": p.prompt, "sampling_params": params})
        r.raise_for_status()
        meta = r.json().get("meta_info") or {}
        return int(meta.get("completion_tokens") or 0), meta
    body = {"messages": p.messages, "max_tokens": max_new_tokens, "temperature": temperature}
    if p.tools:
        # the tools are part of the prompt the target was asked; "none" keeps both engines from
        # requiring a tool-call parser to be configured
        body.update(tools=p.tools, tool_choice="none")
    if engine == "sglang":
        body["return_meta_info"] = True
    r = await client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    data = r.json()
    tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
    meta = ((data.get("choices") or [{}])[0] or {}).get("meta_info") or {}
    return tokens, meta


async def fetch_server_accept(client: httpx.AsyncClient) -> float | None:
    for path in ("/server_info", "/get_server_info"):
        try:
            r = await client.get(path)
        except httpx.HTTPError:
            continue
        if r.status_code == 200:
            return server_accept_length(r.json())
    return None
