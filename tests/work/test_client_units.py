"""Unit tests of the endpoint client's pure parts: SSE parsing, error classification, Kimi parsing, auth."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from regen_service.errors import ConfigError, EndpointTerminalError, RetryableError, RowTerminalError
from regen_service.work.chat_template import loss_mask_for, parse_tool_calls, prompt_ids, split_thinking
from regen_service.work.client.auth import auth_headers, load_api_key
from regen_service.work.client.config import PoolConfig
from regen_service.work.client.http import (
    StallError,
    UncodedStreamError,
    check_abort,
    event_error,
    status_error,
)
from regen_service.work.client.sse import sse_events
from regen_service.work.client.streams import ChatStream, GenerateStream
from schemas.conversation import Message

DEMO_TOKENIZER = Path(__file__).resolve().parents[2] / "regen_service" / "demo" / "tokenizer"


async def _lines(items, delay_s: float = 0.0):
    for x in items:
        if delay_s:
            await asyncio.sleep(delay_s)
        yield x


async def _collect(lines, stall_s: float = 1.0):
    return [e async for e in sse_events(lines, stall_s, "http://e")]


def test_sse_events_parse_until_done():
    lines = [
        ": keep-alive",
        "",
        'data: {"a": 1}',
        "",
        "data: {",
        'data: "b": 2}',
        "",
        "data: [DONE]",
        "",
        'data: {"c":3}',
    ]
    assert asyncio.run(_collect(_lines(lines))) == [{"a": 1}, {"b": 2}]


def test_sse_stream_without_done_is_retryable():
    with pytest.raises(RetryableError, match="before \\[DONE\\]"):
        asyncio.run(_collect(_lines(['data: {"a": 1}', ""])))


def test_sse_stall_timer():
    with pytest.raises(StallError, match="stalled"):
        asyncio.run(_collect(_lines(['data: {"a": 1}', "", "data: [DONE]"], delay_s=0.3), stall_s=0.1))


def test_status_classification():
    assert isinstance(status_error(503, "The request queue is full.", "e"), RetryableError)
    assert isinstance(status_error(500, "x", "e"), RetryableError)
    assert isinstance(status_error(429, "x", "e"), RetryableError)
    assert isinstance(status_error(400, "too long", "e"), RowTerminalError)
    assert isinstance(status_error(422, "bad", "e"), RowTerminalError)
    assert isinstance(status_error(401, "Unauthorized", "e"), EndpointTerminalError)
    assert isinstance(event_error({"message": "x"}, "e"), UncodedStreamError)
    assert isinstance(event_error({"message": "x", "code": 400}, "e"), RowTerminalError)
    assert isinstance(event_error({"message": "x", "code": 503}, "e"), RetryableError)
    with pytest.raises(RetryableError):
        check_abort({"type": "abort", "message": "m", "status_code": 503}, "e")
    with pytest.raises(RowTerminalError):
        check_abort({"type": "abort", "message": "m", "status_code": 400}, "e")
    check_abort({"type": "length", "length": 3}, "e")  # length is data, not an error


def test_generate_stream_cumulative_and_incremental():
    meta_end = {"finish_reason": {"type": "stop", "matched": 7}, "prompt_tokens": 3, "completion_tokens": 3}
    cum = GenerateStream("e", "cumulative")
    for ev in (
        {"text": "a", "output_ids": [1], "meta_info": {"finish_reason": None}},
        {"text": "ab", "output_ids": [1, 2], "meta_info": {"finish_reason": None}},
        {"text": "abc", "output_ids": [1, 2, 7], "meta_info": meta_end},
    ):
        cum.feed(ev)
    inc = GenerateStream("e", "incremental")
    for ev in (
        {"text": "a", "output_ids": [1], "meta_info": {"finish_reason": None}},
        {"text": "b", "output_ids": [2], "meta_info": {"finish_reason": None}},
        {"text": "c", "output_ids": [7], "meta_info": meta_end},
    ):
        inc.feed(ev)
    for acc in (cum, inc):
        c = acc.result()
        assert (c.text, c.output_ids, c.finish_reason, c.completion_tokens) == ("abc", [1, 2, 7], "stop", 3)
        assert c.ttft_s is not None
    with pytest.raises(UncodedStreamError):
        GenerateStream("e", False).feed({"error": {"message": "The input (9 tokens) is longer than ..."}})
    unfinished = GenerateStream("e", False)
    unfinished.feed({"text": "a", "output_ids": [1], "meta_info": {"finish_reason": None}})
    with pytest.raises(RetryableError):
        unfinished.result()


def test_chat_stream_deltas_tools_usage():
    acc = ChatStream("e")
    for chunk in (
        {"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]},
        {"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "functions.f:0",
                                "function": {"name": "f", "arguments": '{"x"'},
                            }
                        ]
                    },
                }
            ]
        },
        {
            "choices": [
                {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}}
            ]
        },
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}},
    ):
        acc.feed(chunk)
    c = acc.result()
    assert (c.reasoning_content, c.content, c.finish_reason, c.completion_tokens) == (
        "hm",
        "Hi",
        "tool_calls",
        9,
    )
    assert [(t.id, t.name, t.arguments) for t in c.tool_calls] == [("functions.f:0", "f", '{"x": 1}')]
    with pytest.raises(RetryableError):
        ChatStream("e").feed({"error": {"message": "queue full", "code": 503}})


def test_kimi_output_parsing_and_loss_mask():
    raw = 'hmm</think>Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    reasoning, answer = split_thinking(raw, prompt_opens_think=True)
    content, calls = parse_tool_calls(answer)
    assert reasoning == "hmm" and content == "Sure."
    assert [(c.id, c.name, c.arguments) for c in calls] == [
        ("functions.get_weather:0", "get_weather", '{"city": "Paris"}')
    ]
    assert split_thinking("still thinking", prompt_opens_think=True) == ("still thinking", "")
    assert split_thinking("plain", prompt_opens_think=False) == (None, "plain")
    assert loss_mask_for([9, 1, 2, 9, 3, 9], [4, 5], [[1, 2], [3], [8]]) == [0, 1, 1, 0, 1, 0, 1, 1]


def test_prompt_ids_use_the_tokenizers_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEMO_TOKENIZER))
    msgs = [Message(role="user", content="hello there")]
    on = prompt_ids(tok, msgs, None, thinking=True)
    off = prompt_ids(tok, msgs, None, thinking=False)
    assert tok.decode(on).endswith("<think>") and tok.decode(off).endswith("<think></think>")
    assert all(isinstance(i, int) for i in on)


def test_api_key_sources_and_secrecy(tmp_path, monkeypatch):
    monkeypatch.setenv("REGEN_TEST_KEY", "sk-secret-123")
    key = load_api_key(env_var="REGEN_TEST_KEY")
    assert auth_headers(key) == {"Authorization": "Bearer sk-secret-123"}
    f = tmp_path / "key"
    f.write_text("sk-file-456\n")
    assert load_api_key(file=str(f)).get_secret_value() == "sk-file-456"
    cfg = PoolConfig(endpoints=["http://a:1"], api_key=key)
    assert "sk-secret-123" not in repr(cfg) and "sk-secret-123" not in str(cfg.model_dump())
    with pytest.raises(ConfigError):
        load_api_key(env_var="REGEN_TEST_KEY_UNSET")
    with pytest.raises(ConfigError):
        load_api_key(env_var="REGEN_TEST_KEY", file=str(f))
