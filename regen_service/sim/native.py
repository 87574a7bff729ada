"""SGLang's native `POST /generate`: JSON or SSE, cumulative or incremental, single or batch.

The engine decides the answer, the timing and the faults; this module only shapes them the way
SGLang does: `{"text","output_ids","meta_info"}`, errors as `{"error":{"message"}}` (HTTP 400/503
before a stream starts, an error event inside HTTP 200 after), abort as a finish_reason.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from regen_service.sim.capacity import QueueFull
from regen_service.sim.engine import BadRequest, ContextTooLong, Engine, Lost, Prepared, Run
from regen_service.sim.faults import ABORT_MESSAGE, ERROR_EVENT_MESSAGE, QUEUE_FULL_MESSAGE
from regen_service.sim.render import AnswerText, delta
from regen_service.sim.wire import (
    drop_connection,
    json_response,
    native_error,
    send_done,
    send_event,
    start_sse,
)

ENGINE = web.AppKey("engine", Engine)


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    try:
        body = await request.json()
    except ValueError:
        return native_error(400, "Invalid JSON body")
    if not isinstance(body, dict):
        return native_error(400, "The request body must be a JSON object")
    sp = body.get("sampling_params") or {}
    stream = bool(body.get("stream"))
    text, ids = body.get("text"), body.get("input_ids")
    batch = text if isinstance(text, list) else ids if ids and isinstance(ids[0], list) else None
    if batch is not None:
        if stream:
            return native_error(400, "The simulator does not stream batch requests; send them one by one.")
        if body.get("image_data") is not None:
            return native_error(
                400, "The simulator takes image_data in single requests only; send them one by one."
            )
        return await _batch(request, engine, body, sp, batch, is_text=isinstance(text, list))
    try:
        prep = engine.prepare_generate(
            text, ids, sp.get("max_new_tokens"), body.get("rid"), body.get("image_data")
        )
    except ContextTooLong as e:
        if stream:
            resp = await start_sse(request)
            await send_event(resp, {"error": {"message": str(e)}})
            await send_done(resp)
            return resp
        return native_error(400, str(e))
    except BadRequest as e:
        return native_error(400, str(e))
    try:
        run = engine.start(prep)
    except QueueFull:
        return native_error(503, QUEUE_FULL_MESSAGE)
    try:
        if stream:
            return await _stream(request, engine, run)
        return await _whole(request, engine, run)
    except Lost:
        return web.Response(status=503)
    finally:
        run.close()


async def _whole(request: web.Request, engine: Engine, run: Run) -> web.StreamResponse:
    k = await run.drain()
    kind = run.plan.kind
    if kind == "disconnect":
        engine.stats.num_disconnects_injected += 1
        drop_connection(request)
        return web.Response()
    if kind == "error_event":
        engine.stats.num_error_events_injected += 1
        return native_error(503, ERROR_EVENT_MESSAGE)
    return json_response(_result(engine, run, AnswerText(run.prep.answer, engine.tok), k))


def _result(engine: Engine, run: Run, view: AnswerText, k: int) -> dict:
    return {
        "text": view.text(k),
        "output_ids": run.prep.answer.ids[:k],
        "meta_info": _final_meta(engine, run, k),
    }


def _final_meta(engine: Engine, run: Run, k: int) -> dict:
    if run.plan.kind == "abort":
        engine.stats.num_aborts_injected += 1
        finish = {"type": "abort", "message": ABORT_MESSAGE, "status_code": 503}
    else:
        finish = engine.natural_finish(run.prep)
    spec = run.finish(k)
    return _meta(run.prep, k, finish) | spec


def _meta(prep: Prepared, k: int, finish: dict | None) -> dict:
    return {
        "id": prep.rid,
        "finish_reason": finish,
        "prompt_tokens": prep.prompt_tokens,
        "completion_tokens": k,
        "cached_tokens": 0,
        "e2e_latency": round(time.monotonic() - prep.t_arrival, 6),
    }


async def _stream(request: web.Request, engine: Engine, run: Run) -> web.StreamResponse:
    resp = await start_sse(request)
    view = AnswerText(run.prep.answer, engine.tok)
    ids = run.prep.answer.ids
    incremental = engine.cfg.incremental_streaming_output
    sent_k, sent_text = 0, ""
    ends_well = run.plan.kind in ("none", "abort")

    def event(k: int, finish: dict | None, meta: dict | None = None) -> dict:
        nonlocal sent_k, sent_text
        text = view.text(k)
        if incremental:
            out = {"text": delta(sent_text, text), "output_ids": ids[sent_k:k]}
        else:
            out = {"text": text, "output_ids": ids[:k]}
        sent_k, sent_text = k, text
        out["meta_info"] = meta if meta is not None else _meta(run.prep, k, finish)
        return out

    k = 0
    async for k in run.updates():
        if k >= run.num_stop and ends_well:
            break  # the last tokens ride on the final event, with the finish reason
        await send_event(resp, event(k, None))
    kind = run.plan.kind
    if kind == "disconnect":
        engine.stats.num_disconnects_injected += 1
        drop_connection(request)
        return resp
    if kind == "error_event":
        engine.stats.num_error_events_injected += 1
        await send_event(resp, {"error": {"message": ERROR_EVENT_MESSAGE, "code": 503}})
    else:
        await send_event(resp, event(k, None, _final_meta(engine, run, k)))
    await send_done(resp)
    return resp


async def _batch(request, engine: Engine, body: dict, sp: dict, items: list, is_text: bool) -> web.Response:
    """Non-streaming batch: every item runs as its own request; results come back in order."""
    rids = body.get("rid") if isinstance(body.get("rid"), list) else [None] * len(items)
    try:
        preps = [
            engine.prepare_generate(*((it, None) if is_text else (None, it)), sp.get("max_new_tokens"), rid)
            for it, rid in zip(items, rids, strict=False)
        ]
    except BadRequest as e:
        return native_error(400, str(e))
    runs: list[Run] = []
    try:
        for prep in preps:
            # a batch is one HTTP exchange: injected faults would have no per-item shape, so none apply
            runs.append(engine.start(prep, faults=False))
    except QueueFull:
        for run in runs:
            run.close()
        return native_error(503, QUEUE_FULL_MESSAGE)

    async def one(run: Run) -> dict:
        try:
            k = await run.drain()
            return _result(engine, run, AnswerText(run.prep.answer, engine.tok), k)
        finally:
            run.close()

    try:
        return json_response(list(await asyncio.gather(*(one(r) for r in runs))))
    except Lost:
        return web.Response(status=503)
