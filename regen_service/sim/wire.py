"""SGLang's wire shapes shared by the routes: error bodies, SSE events, dropping a connection.

Native errors are `{"error": {"message": ...}}`; `/v1/*` errors are OpenAI-style objects. Deciding
which error applies is left to the routes.
"""

from __future__ import annotations

import json

from aiohttp import web

_OPENAI_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 503: "ServiceUnavailableError"}
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def json_response(obj, status: int = 200) -> web.Response:
    return web.Response(text=dumps(obj), status=status, content_type="application/json")


def native_error(status: int, message: str) -> web.Response:
    return json_response({"error": {"message": message}}, status)


def openai_error_body(status: int, message: str) -> dict:
    return {
        "object": "error",
        "message": message,
        "type": _OPENAI_TYPES.get(status, "InternalServerError"),
        "param": None,
        "code": status,
    }


def openai_error(status: int, message: str) -> web.Response:
    return json_response(openai_error_body(status, message), status)


async def start_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers=_SSE_HEADERS)
    await resp.prepare(request)
    return resp


async def send_event(resp: web.StreamResponse, obj) -> None:
    await resp.write(f"data: {dumps(obj)}\n\n".encode())


async def send_done(resp: web.StreamResponse) -> None:
    await resp.write(b"data: [DONE]\n\n")


def drop_connection(request: web.Request) -> None:
    """Close the TCP connection at once, mid-response: what a crashed server looks like."""
    if request.transport is not None:
        request.transport.abort()
