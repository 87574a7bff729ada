"""The simulator's own admin endpoints under /sim: stats, runtime config, outages.

These are not part of SGLang's API; tests and benchmarks use them to read the capacity model's
numbers (`GET /sim/stats`), to change faults or speeds while the server runs (`POST /sim/config`)
and to kill the server for a while (`POST /sim/outage`). The outage mechanics are in outage.py.
"""

from __future__ import annotations

from aiohttp import web
from pydantic import ValidationError

from regen_service.sim.info import public_config
from regen_service.sim.native import ENGINE
from regen_service.sim.outage import OUTAGE
from regen_service.sim.wire import json_response, native_error


async def stats(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return json_response(engine.stats.snapshot(engine.cfg.capacity_tok_s, engine.cfg.max_running_requests))


async def stats_reset(request: web.Request) -> web.Response:
    request.app[ENGINE].stats.reset()
    return await stats(request)


async def get_config(request: web.Request) -> web.Response:
    return json_response(public_config(request))


async def set_config(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        patch = await request.json()
    except ValueError:
        return native_error(400, "Invalid JSON body")
    if not isinstance(patch, dict):
        return native_error(400, "POST /sim/config takes a JSON object of the fields to change")
    try:
        engine.cfg = engine.cfg.updated(patch)
    except ValidationError as e:
        return native_error(400, "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()))
    except ValueError as e:
        return native_error(400, str(e))
    return json_response(public_config(request))


async def outage(request: web.Request) -> web.Response:
    try:
        body = await request.json()
        duration_s = float(body["duration_s"])
    except (ValueError, KeyError, TypeError):
        return native_error(400, 'POST /sim/outage takes {"duration_s": seconds}')
    if not 0 < duration_s <= 3600:
        return native_error(400, "duration_s must be in (0, 3600]")
    request.app[OUTAGE].schedule(duration_s)
    return json_response({"outage_s": duration_s})
