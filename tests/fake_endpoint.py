"""A hostile SGLang look-alike for tests, run as its own process: `python -m tests.fake_endpoint --port P
--mode M`. The control paths (/health, /v1/models, /get_server_info) answer like SGLang; the chat path
misbehaves as the mode says:
  echo      the prompt picks the status (code400 / code401 / code500 in it); error bodies quote the
            request's Authorization header, as a careless proxy would; other prompts are answered
  huge      every non-streaming reply is an endless JSON body (1 MiB chunks, no Content-Length)
  endless   every stream keeps sending content events and never sends [DONE]
  malformed prompts with badjson / list / wrongtype / missing get a 200 of that shape; others answered
  deny      every chat request gets a 401 quoting the Authorization header
"""

from __future__ import annotations

import argparse
import json

from aiohttp import web

MODEL = "moonshotai/Kimi-K2.5"


def _sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


async def _answer(request: web.Request, body: dict) -> web.StreamResponse:
    if not body.get("stream"):
        return web.json_response({
            "choices": [{"message": {"role": "assistant", "content": "a fine answer"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3},
        })  # fmt: skip
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(_sse({"choices": [{"index": 0, "delta": {"content": "a fine answer"}}]}))
    await resp.write(_sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    await resp.write(_sse({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}))
    await resp.write(_sse(b"[DONE]"))
    return resp


def _echo_error(request: web.Request, status: int) -> web.Response:
    auth = request.headers.get("Authorization", "")
    return web.json_response(
        {"error": {"message": f"request refused; you sent Authorization: {auth}", "code": status}},
        status=status,
    )


async def _endless_body(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    chunk = b" " * (1 << 20)
    await resp.write(b'{"choices": [{"message": {"content": "')
    for _ in range(100_000):  # 100 GB if nobody cuts it
        await resp.write(chunk)
    return resp


async def _endless_stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    event = _sse({"choices": [{"index": 0, "delta": {"content": "y" * 16384}}]})
    for _ in range(10_000_000):
        await resp.write(event)
    return resp


MALFORMED = {
    "badjson": b'{"choices": [{"message": {"content": "trunc',
    "list": b"[1, 2, 3]",
    "wrongtype": json.dumps({"choices": [{"message": {"content": 5}, "finish_reason": "stop"}]}).encode(),
    "missing": json.dumps({"choices": [{"message": {"content": "no finish reason"}}]}).encode(),
    "choices": json.dumps({"choices": "not a list"}).encode(),
}


async def chat(request: web.Request) -> web.StreamResponse:
    mode = request.app["mode"]
    body = await request.json()
    prompt = json.dumps(body.get("messages"))
    if mode == "deny":
        return _echo_error(request, 401)
    if mode == "echo":
        for code in (400, 401, 500):
            if f"code{code}" in prompt:
                return _echo_error(request, code)
    if mode == "huge" and not body.get("stream"):
        return await _endless_body(request)
    if mode == "endless" and body.get("stream"):
        return await _endless_stream(request)
    if mode == "malformed" and not body.get("stream"):
        for word, payload in MALFORMED.items():
            if word in prompt:
                return web.Response(body=payload, content_type="application/json")
    return await _answer(request, body)


async def health(_request) -> web.Response:
    return web.Response(text="ok")


async def models(_request) -> web.Response:
    return web.json_response({"data": [{"id": MODEL, "max_model_len": 32768}]})


async def server_info(_request) -> web.Response:
    return web.json_response({"max_running_requests": 4, "max_queued_requests": 64, "context_length": 32768})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", required=True, choices=["echo", "huge", "endless", "malformed", "deny"])
    args = ap.parse_args()
    app = web.Application(client_max_size=64 << 20)
    app["mode"] = args.mode
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
