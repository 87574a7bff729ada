"""A second hostile SGLang look-alike (issue 18, round two), run as its own process:
`python -m tests.work.hostile_endpoint --port P --mode M`. Control paths answer like SGLang
(tests.fake_endpoint's handlers); the chat path misbehaves as the mode says. The API key it quotes is
the one the client sent in its Authorization header, as a careless proxy would.
  quote      the prompt picks the reply:
               straddle500  a 400 whose error message puts the key across character 500
               straddle503  a 503 whose plain-text body puts the key across character 500
               straddle200  (streaming) an event that is not JSON, the key across character 200
               inject       a 503 whose body carries CR/LF, ESC and a forged "shard ... done" log line
               echo         a 200 answer quoting the key in its content, reasoning and tool-call
                            arguments (streamed: the key split across two deltas)
             other prompts are answered
  deny       every chat request gets a 401 whose message forges a log line
  nodelim    every stream sends `data: x` lines forever and never the blank line that ends an event
  keepalive  every stream sends one content event, then `: keepalive` every 0.2 s forever
  nondict    every stream sends `data: 1` events (JSON, but not objects) forever
"""

from __future__ import annotations

import argparse
import asyncio
import json

from aiohttp import web

from tests.fake_endpoint import _answer, _sse, health, models, server_info

FORGED = "\r\n[INFO] shard run/0 done\x1b[2K"
PAD = "p" * 490  # the key starts at character 490: a cut at 500 keeps its first 10 characters


def _key(request: web.Request) -> str:
    return request.headers.get("Authorization", "").removeprefix("Bearer ")


async def _stream(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    return resp


def _echo_body(key: str) -> dict:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "lookup", "arguments": json.dumps({"k": key})},
    }
    return {
        "choices": [{
            "message": {"role": "assistant", "content": f"your key is {key}, keep it",
                        "reasoning_content": f"they sent {key}", "tool_calls": [call]},
            "finish_reason": "tool_calls",
        }],
        "usage": {"prompt_tokens": 5, "completion_tokens": 9},
    }  # fmt: skip


async def _echo(request: web.Request, body: dict, key: str) -> web.StreamResponse:
    if not body.get("stream"):
        return web.json_response(_echo_body(key))
    resp = await _stream(request)
    half = len(key) // 2
    for delta in (
        {"reasoning_content": f"they sent {key[:half]}"},
        {"reasoning_content": f"{key[half:]}"},
        {"content": f"your key is {key[:half]}"},
        {"content": f"{key[half:]}, keep it"},
        {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "lookup", "arguments": '{"k": "'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": key[:half]}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": key[half:] + '"}'}}]},
    ):
        await resp.write(_sse({"choices": [{"index": 0, "delta": delta}]}))
    await resp.write(_sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}))
    await resp.write(_sse({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}}))
    await resp.write(_sse(b"[DONE]"))
    return resp


async def _quote(request: web.Request, body: dict, prompt: str) -> web.StreamResponse:
    key = _key(request)
    if "straddle500" in prompt:
        return web.json_response({"error": {"message": f"{PAD}{key} was refused", "code": 400}}, status=400)
    if "straddle503" in prompt:
        return web.Response(text=f"{PAD}{key} overloaded", status=503)
    if "straddle200" in prompt and body.get("stream"):
        resp = await _stream(request)
        await resp.write(b"data: " + ("q" * 190 + key + " not json").encode() + b"\n\n")
        return resp
    if "inject" in prompt:
        return web.Response(text=f"overloaded{FORGED}", status=503)
    if "echo" in prompt:
        return await _echo(request, body, key)
    return await _answer(request, body)


async def _forever(request: web.Request, first: bytes, line: bytes, pause_s: float) -> web.StreamResponse:
    resp = await _stream(request)
    await resp.write(first)
    while True:  # until the client hangs up (the write then fails)
        await resp.write(line)
        await asyncio.sleep(pause_s)


async def chat(request: web.Request) -> web.StreamResponse:
    mode = request.app["mode"]
    body = await request.json()
    prompt = json.dumps(body.get("messages"))
    if mode == "deny":
        return web.json_response({"error": {"message": f"bad key{FORGED}", "code": 401}}, status=401)
    if mode == "quote":
        return await _quote(request, body, prompt)
    if mode == "nodelim":  # 64 KiB of `data: x` lines per write, never a blank line
        return await _forever(request, b"", b"data: x\n" * 8192, 0)
    if mode == "keepalive":
        first = _sse({"choices": [{"index": 0, "delta": {"content": "a start"}}]})
        return await _forever(request, first, b": keepalive\n", 0.2)
    if mode == "nondict":
        return await _forever(request, b"", b"data: 1\n\n" * 64, 0.01)
    return await _answer(request, body)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", required=True, choices=["quote", "deny", "nodelim", "keepalive", "nondict"])
    args = ap.parse_args()
    app = web.Application()
    app["mode"] = args.mode
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
