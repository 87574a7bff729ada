"""The simulator's aiohttp application and process lifecycle.

`build_app` wires the routes of native.py, openai_api.py, info.py and admin.py behind one
middleware (API key check, and dropping connections that slip in during an outage); `serve` runs
it with the scheduler's tick loop and the throughput sampler until the process is signalled. The
HTTP shapes themselves live in the route modules.
`run(cfg)` serves on uvloop where installed (regen_service.loops).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from aiohttp import web

from regen_service import loops
from regen_service.sim import admin, info, native, openai_api
from regen_service.sim.config import SimConfig
from regen_service.sim.engine import Engine
from regen_service.sim.native import ENGINE
from regen_service.sim.outage import OUTAGE, Outage
from regen_service.sim.wire import drop_connection, json_response

log = logging.getLogger("regen.sim")


_OPEN_PATHS = ("/health", "/health_generate", "/metrics")


@web.middleware
async def _guard(request: web.Request, handler):
    app = request.app
    if app[OUTAGE].active and request.path != "/health_generate":
        # a connection accepted just before the socket closed: it dies like the rest
        drop_connection(request)
        return web.Response(status=503)
    key = app[ENGINE].cfg.api_key
    if key and request.path not in _OPEN_PATHS and request.headers.get("Authorization") != f"Bearer {key}":
        return json_response({"error": "Unauthorized"}, 401)
    return await handler(request)


def build_app(engine: Engine) -> web.Application:
    app = web.Application(middlewares=[_guard], client_max_size=256 * 1024 * 1024)
    app[ENGINE] = engine
    app[OUTAGE] = Outage(engine.scheduler, engine.cfg.host)
    r = app.router
    r.add_post("/generate", native.generate)
    r.add_post("/v1/chat/completions", openai_api.chat_completions)
    r.add_get("/v1/models", openai_api.models)
    r.add_get("/health", info.health)
    r.add_get("/health_generate", info.health_generate)
    for path in ("/get_model_info", "/model_info"):
        r.add_get(path, info.model_info)
    for path in ("/get_server_info", "/server_info"):
        r.add_get(path, info.server_info)
    r.add_get("/metrics", info.metrics)
    r.add_get("/sim/stats", admin.stats)
    r.add_post("/sim/stats/reset", admin.stats_reset)
    r.add_get("/sim/config", admin.get_config)
    r.add_post("/sim/config", admin.set_config)
    r.add_post("/sim/outage", admin.outage)
    return app


async def _sample_throughput(engine: Engine) -> None:
    while True:
        await asyncio.sleep(0.5)
        engine.stats.sample_throughput()


async def serve(cfg: SimConfig) -> None:
    engine = Engine(cfg)
    app = build_app(engine)
    outage = app[OUTAGE]
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True)
    await site.start()
    port = runner.addresses[0][1] if cfg.port == 0 else cfg.port
    outage.attach(runner, port)
    tasks = [asyncio.create_task(engine.scheduler.run()), asyncio.create_task(_sample_throughput(engine))]
    mode = "instant (decode_tok_s=0)" if cfg.instant else f"{cfg.capacity_tok_s:.1f} tok/s at full batch"
    log.info(
        "regen sim serving %s on http://%s:%d: capacity %s (R=%d, D=%g tok/s, A=%g, Q=%d), tokenizer %s, seed %d",
        cfg.model,
        cfg.host,
        port,
        mode,
        cfg.max_running_requests,
        cfg.decode_tok_s,
        cfg.batch_slowdown,
        cfg.max_queued_requests,
        cfg.tokenizer_path or "synthetic",
        cfg.seed,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(Exception):
            await runner.cleanup()


def run(cfg: SimConfig) -> None:
    """Serve until signalled, on uvloop where installed."""
    loops.run(serve(cfg))
