"""SGLang's read-only endpoints: health, model info, server info, Prometheus metrics.

They report the engine's config and live stats in SGLang's shapes (avg_spec_accept_length inside
internal_states, not at the top level); the extra `sim` object in server info carries the capacity
model's numbers for benchmarks. Generation routes are in native.py and openai_api.py.
"""

from __future__ import annotations

from aiohttp import web

from regen_service.sim.config import SGLANG_API_VERSION
from regen_service.sim.native import ENGINE
from regen_service.sim.outage import OUTAGE
from regen_service.sim.wire import json_response


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def health_generate(request: web.Request) -> web.Response:
    return web.Response(status=503 if request.app[OUTAGE].active else 200)


async def model_info(request: web.Request) -> web.Response:
    cfg = request.app[ENGINE].cfg
    return json_response(
        {
            "model_path": cfg.model,
            "tokenizer_path": cfg.tokenizer_path or cfg.model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
        }
    )


def sim_summary(request: web.Request) -> dict:
    engine = request.app[ENGINE]
    cfg = engine.cfg
    return {
        "capacity_tok_s": round(cfg.capacity_tok_s, 3),
        "per_request_tok_s_at_full_batch": round(cfg.per_request_tok_s(cfg.max_running_requests), 4),
        "tokenizer": "hf" if cfg.tokenizer_path else "synthetic",
        "stats": engine.stats.snapshot(cfg.capacity_tok_s, cfg.max_running_requests),
        "config": public_config(request),
    }


def public_config(request: web.Request) -> dict:
    cfg = request.app[ENGINE].cfg
    return cfg.model_dump() | {"api_key": "***" if cfg.api_key else None}


async def server_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    cfg = engine.cfg
    state = {
        "last_gen_throughput": round(engine.stats.last_gen_throughput, 3),
        "memory_usage": {
            "weight": 595.0,
            "kvcache": 40.0,
            "token_capacity": cfg.max_total_num_tokens,
            "graph": 2.5,
        },
    }
    avg = engine.stats.avg_spec_accept_length
    if cfg.spec_on and avg is not None:
        state["avg_spec_accept_length"] = round(avg, 4)
    spec_steps = max(1, round(cfg.spec_accept_length)) if cfg.spec_on else None
    out = {
        "model_path": cfg.model,
        "tokenizer_path": cfg.tokenizer_path or cfg.model,
        "served_model_name": cfg.model,
        "host": cfg.host,
        "port": cfg.port,
        "api_key": None,
        "context_length": cfg.context_length,
        "max_running_requests": cfg.max_running_requests,
        "max_queued_requests": cfg.max_queued_requests,
        "reasoning_parser": None if cfg.reasoning_parser == "none" else cfg.reasoning_parser,
        "tool_call_parser": None if cfg.tool_call_parser == "none" else cfg.tool_call_parser,
        "incremental_streaming_output": cfg.incremental_streaming_output,
        "enable_metrics": True,
        "random_seed": cfg.seed,
        "speculative_algorithm": "EAGLE3" if cfg.spec_on else None,
        "speculative_num_steps": spec_steps,
        "speculative_eagle_topk": 1 if cfg.spec_on else None,
        "speculative_num_draft_tokens": spec_steps + 1 if spec_steps else None,
        "max_total_num_tokens": cfg.max_total_num_tokens,
        "max_req_input_len": cfg.context_length - 1,
        "version": SGLANG_API_VERSION,
        "internal_states": [state],
        "sim": sim_summary(request),
    }
    return json_response(out)


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.Response(text=engine.stats.prometheus(engine.cfg.model), content_type="text/plain")
