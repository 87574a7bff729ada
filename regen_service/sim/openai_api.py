"""The OpenAI-compatible routes: `POST /v1/chat/completions` (JSON and SSE) and `GET /v1/models`.

Shapes follow SGLang's serving_chat with `--reasoning-parser kimi_k2 --tool-call-parser kimi_k2`:
reasoning_content split from content, complete tool calls as `tool_calls` with finish_reason
`tool_calls`, `role` only in the first stream chunk, the finish reason in its own chunk with an empty
delta, a usage chunk only with `stream_options.include_usage`. Errors before the first chunk are
real HTTP errors in OpenAI's error shape; after it, an error event. Timing and faults come from the
engine.
"""

from __future__ import annotations

import time

from aiohttp import web

from regen_service.sim.capacity import QueueFull
from regen_service.sim.engine import BadRequest, Engine, Lost, Run
from regen_service.sim.faults import ERROR_EVENT_MESSAGE, QUEUE_FULL_MESSAGE
from regen_service.sim.native import ENGINE
from regen_service.sim.render import AnswerText, ChatParts, delta
from regen_service.sim.wire import (
    drop_connection,
    json_response,
    openai_error,
    openai_error_body,
    send_done,
    send_event,
    start_sse,
)


async def models(request: web.Request) -> web.Response:
    cfg = request.app[ENGINE].cfg
    return json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": cfg.model,
                    "object": "model",
                    "owned_by": "sglang",
                    "root": cfg.model,
                    "max_model_len": cfg.context_length,
                }
            ],
        }
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        body = await request.json()
    except ValueError:
        return openai_error(400, "Invalid JSON body")
    if not isinstance(body, dict):
        return openai_error(400, "The request body must be a JSON object")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    try:
        prep = engine.prepare_chat(
            body.get("messages"),
            body.get("tools"),
            body.get("chat_template_kwargs") or {},
            max_tokens,
            body.get("rid"),
        )
        run = engine.start(prep)
    except BadRequest as e:
        return openai_error(400, str(e))
    except QueueFull:
        return openai_error(503, QUEUE_FULL_MESSAGE)
    cfg = engine.cfg
    reasoning = cfg.reasoning_parser == "kimi_k2" and body.get("separate_reasoning", True) is not False
    tools = cfg.tool_call_parser == "kimi_k2"
    try:
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await _stream(request, engine, run, reasoning, tools, include_usage)
        return await _whole(request, engine, run, reasoning, tools, bool(body.get("return_meta_info")))
    except Lost:
        return web.Response(status=503)
    finally:
        run.close()


def _finish(engine: Engine, run: Run, parts: ChatParts) -> str:
    if run.plan.kind == "abort":
        engine.stats.num_aborts_injected += 1
        return "abort"
    if parts.tool_call is not None:
        return "tool_calls"
    return "length" if run.prep.cut else "stop"


def _tool_calls(parts: ChatParts) -> list[dict] | None:
    if parts.tool_call is None:
        return None
    call = parts.tool_call
    return [
        {
            "id": f"functions.{call.name}:0",
            "index": 0,
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
    ]


def _usage(run: Run, k: int, parts: ChatParts) -> dict:
    p = run.prep.prompt_tokens
    return {
        "prompt_tokens": p,
        "completion_tokens": k,
        "total_tokens": p + k,
        "reasoning_tokens": parts.reasoning_tokens,
    }


def _base(run: Run, engine: Engine, obj: str) -> dict:
    return {"id": run.prep.rid, "object": obj, "created": int(time.time()), "model": engine.cfg.model}


async def _whole(
    request, engine: Engine, run: Run, reasoning: bool, tools: bool, meta_info: bool = False
) -> web.StreamResponse:
    k = await run.drain()
    if run.plan.kind == "disconnect":
        engine.stats.num_disconnects_injected += 1
        drop_connection(request)
        return web.Response()
    if run.plan.kind == "error_event":
        engine.stats.num_error_events_injected += 1
        return openai_error(503, ERROR_EVENT_MESSAGE)
    parts = AnswerText(run.prep.answer, engine.tok).chat(k, reasoning, tools)
    finish = _finish(engine, run, parts)
    calls = _tool_calls(parts)
    message = {
        "role": "assistant",
        "content": parts.content if parts.content or calls is None else None,
        "reasoning_content": parts.reasoning,
        "tool_calls": calls,
    }
    spec = run.finish(k)
    choice = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": finish,
        "matched_stop": engine.tok.im_end_id if finish == "stop" else None,
    }
    if meta_info:  # SGLang's `return_meta_info`: the native meta_info on the choice (non-streaming)
        choice["meta_info"] = {
            "id": run.prep.rid,
            "prompt_tokens": run.prep.prompt_tokens,
            "completion_tokens": k,
            **spec,
        }
    out = _base(run, engine, "chat.completion") | {"choices": [choice], "usage": _usage(run, k, parts)}
    return json_response(out)


async def _stream(request, engine: Engine, run: Run, reasoning: bool, tools: bool, include_usage: bool):
    resp = await start_sse(request)
    view = AnswerText(run.prep.answer, engine.tok)
    base = _base(run, engine, "chat.completion.chunk")

    async def chunk(delta_: dict, finish: str | None = None, **extra) -> None:
        choice = {"index": 0, "delta": delta_, "logprobs": None, "finish_reason": finish} | extra
        await send_event(resp, base | {"choices": [choice]})

    await chunk({"role": "assistant", "content": ""})
    sent_reasoning, sent_content, sent_tool = "", "", False
    k = 0
    parts = view.chat(0, reasoning, tools)
    async for k in run.updates():
        parts = view.chat(k, reasoning, tools)
        if parts.reasoning and (d := delta(sent_reasoning, parts.reasoning)):
            await chunk({"reasoning_content": d})
            sent_reasoning = parts.reasoning
        if parts.content and (d := delta(sent_content, parts.content)):
            await chunk({"content": d})
            sent_content = parts.content
        if parts.tool_call is not None and not sent_tool:
            await chunk({"tool_calls": _tool_calls(parts)})
            sent_tool = True
    if run.plan.kind == "disconnect":
        engine.stats.num_disconnects_injected += 1
        drop_connection(request)
        return resp
    if run.plan.kind == "error_event":
        engine.stats.num_error_events_injected += 1
        await send_event(resp, {"error": openai_error_body(503, ERROR_EVENT_MESSAGE)})
        await send_done(resp)
        return resp
    finish = _finish(engine, run, parts)
    run.finish(k)
    await chunk({}, finish, matched_stop=engine.tok.im_end_id if finish == "stop" else None)
    if include_usage:
        await send_event(resp, base | {"choices": [], "usage": _usage(run, k, parts)})
    await send_done(resp)
    return resp
