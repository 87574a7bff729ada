"""Which engine serves an endpoint, SGLang or vLLM, and what the token-exact API looks like on each.

Detection (`engine_from`): SGLang answers `/get_server_info` (older builds) or `/server_info` with its
server arguments; vLLM answers `/version` with `{"version": ...}` and lists its models with
`owned_by: "vllm"` (its `/server_info` exists only in dev mode and holds `vllm_config`). An endpoint that
answers like neither is refused with what to do (`--engine` forces one, e.g. behind a proxy).

The chat API is OpenAI's on both. The token-exact API (`api: generate` in a mix) is SGLang's native
`/generate` (`input_ids` in, `output_ids` out) and vLLM's `/v1/completions` with a token-id prompt and
`return_token_ids` (vLLM 0.32 `entrypoints/openai/completion/protocol.py`: `choices[0].token_ids`, deltas
when streaming). The regenerator builds SGLang's payload; `vllm_completions_body` translates it, and
`CompletionsStream` / `completions_from_body` fold vLLM's answers into the same Completion. Sending
requests and classifying HTTP errors are endpoint.py's and http.py's.
"""

from __future__ import annotations

import json
from typing import Literal

from regen_service.errors import EndpointTerminalError, RowTerminalError
from regen_service.work.client.http import Completion, RetryableError, event_error
from regen_service.work.client.server_text import server_text

Engine = Literal["sglang", "vllm"]
EngineChoice = Literal["auto", "sglang", "vllm"]
VLLM_COMPLETIONS_PATH = "/v1/completions"


class NotAnEngineError(EndpointTerminalError):
    """The endpoint answers like neither SGLang nor vLLM: regen does not guess how to drive it."""


def _json(raw: bytes | None) -> object:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None


def engine_from(server_info: bytes | None, version: bytes | None, models: bytes | None, label: str) -> Engine:
    """The engine behind an endpoint from what it answered on its info paths (None: 404)."""
    info = _json(server_info)
    if isinstance(info, dict):
        return "vllm" if "vllm_config" in info else "sglang"
    ver, listed = _json(version), _json(models)
    owners = {m.get("owned_by") for m in (listed or {}).get("data") or [] if isinstance(m, dict)}
    if isinstance(ver, dict) and "version" in ver and "vllm" in owners:
        return "vllm"
    raise NotAnEngineError(
        f"{label} answers neither like SGLang (/get_server_info, /server_info) nor like vLLM (/version, and "
        f"/v1/models owned by vllm; it lists owners {server_text(sorted(str(o) for o in owners if o))}); regen drives those two "
        "engines: start one of them there, or pass --engine sglang|vllm if a proxy hides those paths",
        endpoint=label,
    )


def vllm_completions_body(payload: dict, model: str) -> dict:
    """SGLang's /generate payload ({"input_ids", "sampling_params"}) as a vLLM /v1/completions body.

    A payload with `image_data` is refused (RowTerminalError): this body (a token-id prompt) has no
    place for images, and vLLM documents image input on /v1/chat/completions, so translating would drop
    the images and have the target answer a picture it never saw."""
    if payload.get("image_data"):
        raise RowTerminalError(
            f"the prompt has {len(payload['image_data'])} image(s) and api generate on vLLM sends a token-id "
            "prompt to /v1/completions, which carries no images here; use api: chat for image mixes on vLLM "
            "endpoints (or SGLang endpoints, whose /generate takes image_data)"
        )
    sp = payload.get("sampling_params") or {}
    body: dict = {
        "model": model,
        "prompt": list(payload["input_ids"]),
        "max_tokens": sp.get("max_new_tokens"),
        "return_token_ids": True,
        # The raw text must decode every token, markers included, exactly as SGLang's does.
        "skip_special_tokens": bool(sp.get("skip_special_tokens", False)),
        "spaces_between_special_tokens": False,
    }
    for key in ("temperature", "top_p", "top_k", "min_p"):
        if key in sp:
            body[key] = sp[key]
    if sp.get("sampling_seed") is not None:
        body["seed"] = sp["sampling_seed"]
    return body


def _missing_ids(label: str) -> EndpointTerminalError:
    return EndpointTerminalError(
        f"{label} answered without token ids: this vLLM does not support return_token_ids on "
        "/v1/completions; upgrade it (regen is tested against vLLM 0.32), or use api: chat",
        endpoint=label,
    )


def _completion(text: str, ids: list[int] | None, finish, stop, usage: dict, label: str) -> Completion:
    if finish == "abort":
        raise RetryableError(f"{label} aborted the request", endpoint=label)
    return Completion(
        text=text,
        output_ids=ids,
        finish_reason=finish,
        matched_stop=stop,
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens", len(ids) if ids is not None else None),
        endpoint=label,
    )


def completions_from_body(body: dict, label: str) -> Completion:
    """A non-streaming vLLM /v1/completions answer."""
    if "error" in body:
        raise event_error(body["error"], label)
    choices = body.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        raise RetryableError(f"{label} answered without choices", endpoint=label)
    c = choices[0]
    if c.get("token_ids") is None:
        raise _missing_ids(label)
    return _completion(
        c.get("text") or "",
        [int(i) for i in c["token_ids"]],
        c.get("finish_reason"),
        c.get("stop_reason"),
        body.get("usage") or {},
        label,
    )


class CompletionsStream:
    """Folds vLLM /v1/completions stream chunks: text and token_ids arrive as deltas, the usage last."""

    def __init__(self, label: str, timer) -> None:
        self.label = label
        self.text: list[str] = []
        self.ids: list[int] = []
        self.saw_ids = False
        self.finish: str | None = None
        self.stop: object = None
        self.usage: dict = {}
        self.timer = timer

    def feed(self, chunk: dict) -> None:
        if "error" in chunk:
            raise event_error(chunk["error"], self.label)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("text"):
                self.text.append(choice["text"])
            if choice.get("token_ids") is not None:
                self.saw_ids = True
                self.ids.extend(int(i) for i in choice["token_ids"])
                if choice["token_ids"]:
                    self.timer.token()
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
                self.stop = choice.get("stop_reason")

    def result(self) -> Completion:
        if self.finish is None:
            raise RetryableError(
                f"{self.label} ended the stream without a finish_reason", endpoint=self.label
            )
        if not self.saw_ids:
            raise _missing_ids(self.label)
        c = _completion("".join(self.text), self.ids, self.finish, self.stop, self.usage, self.label)
        return self.timer.finish(c)
