"""Raw Kimi output split as SGLang's `kimi_k2` reasoning and tool-call parsers split it, and
`thinking: strip` dropping reasoning from the stored row only, never from what the target sees next.

The end-to-end test runs api: generate against the simulator serving the scaled-down Kimi-K2.5 folder
(its slow tokenizer and template), so the prompts are the real template's."""

from __future__ import annotations

import asyncio

import pytest

from regen_service.kimi_fixture import build_kimi_fixture
from regen_service.remote_code import load_tokenizer
from regen_service.work.chat_template import parse_tool_calls, split_thinking
from schemas.conversation import Message, ToolCall
from schemas.mix import MixSpec
from tests.procs import sim_server
from tests.work.test_client_faults import FAST, MODEL, make_record, regenerate_all

CALL = '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'  # fmt: skip


def test_reasoning_split_like_sglang_kimi_k2():
    # the usual shape: reasoning, </think>, answer (the stop token belongs to neither)
    assert split_thinking("why</think>Because.<|im_end|>", prompt_opens_think=True) == ("why", "Because.")
    # a tool-call section that starts before </think> ends the reasoning; the section stays in the answer
    reasoning, answer = split_thinking("let me look" + CALL + "<|im_end|>", prompt_opens_think=True)
    assert reasoning == "let me look" and answer == CALL
    content, calls = parse_tool_calls(answer)
    assert content == "" and [(c.id, c.name, c.arguments) for c in calls] == [
        ("functions.get_weather:0", "get_weather", '{"city": "Paris"}')
    ]
    # never closed and no tool call: all reasoning (cut by the length limit, or not)
    assert split_thinking("still thinking", prompt_opens_think=True) == ("still thinking", "")
    # the text opens <think> itself (leading ones dropped); thinking off and no marker: all answer
    assert split_thinking("<think><think>a</think>b", prompt_opens_think=False) == ("a", "b")
    assert split_thinking("plain" + CALL, prompt_opens_think=False) == (None, "plain" + CALL)


def test_tool_call_ids_and_arguments_as_sglang_reads_them():
    text = (
        "x<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.ns.search:3<|tool_call_argument_begin|>{"q": "a"}<|tool_call_end|>'
        '<|tool_call_begin|>lookup:4<|tool_call_argument_begin|> {"k": 1} <|tool_call_end|>'
        '<|tool_call_begin|>functions.bad<|tool_call_argument_begin|>{"k": 1}<|tool_call_end|>'
        '<|tool_call_begin|>functions.multi:5<|tool_call_argument_begin|>{"a":\n1}<|tool_call_end|>'
        "<|tool_calls_section_end|>"
    )
    content, calls = parse_tool_calls(text)
    assert content == "x"
    # `functions.` prefix and index dropped from the name; ids without an index and arguments over
    # several lines are not calls to SGLang's kimi_k2 parser, so not here either
    assert [(c.id, c.name, c.arguments) for c in calls] == [
        ("functions.ns.search:3", "ns.search", '{"q": "a"}'),
        ("lookup:4", "lookup", '{"k": 1}'),
    ]


TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
)


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    return build_kimi_fixture(tmp_path_factory.mktemp("kimi") / "Kimi-K2.5")


def _mix(kimi_dir, thinking: str) -> MixSpec:
    return MixSpec.model_validate(
        {
            "name": "t",
            "target": {
                "model": MODEL,
                "api": "generate",
                "tokenizer": str(kimi_dir),
                "trust_remote_code": True,
            },
            "sampling": {"max_new_tokens": 256},
            "regenerate": {"turns": "all", "thinking": thinking},
            "sources": [{"name": "s", "path": "x.jsonl", "format": "messages"}],
        }
    )


def test_strip_keeps_reasoning_in_the_requests_of_an_in_progress_tool_task(kimi_dir):
    tok = load_tokenizer(kimi_dir, trust_remote_code=True, setting="test")
    call = ToolCall(id="c1", name="get_weather", arguments='{"city": "Paris"}')
    records = [
        make_record(
            i,
            [
                Message(role="user", content=f"weather in Paris, day {i}?"),
                Message(role="assistant", content="", tool_calls=(call,)),
                Message(role="tool", tool_call_id="c1", content="sunny, 24C"),
                Message(role="assistant", content="Sunny."),
            ],
            tools=TOOLS,
        )
        for i in range(4)
    ]
    args = (
        "--tokenizer",
        str(kimi_dir),
        "--trust-remote-code",
        "--decode-tok-s",
        "0",
        "--think-prob",
        "1",
        "--tool-call-prob",
        "1",
    )
    with sim_server(*FAST, *args) as url:
        keep, _ = asyncio.run(regenerate_all([url], records, mix=_mix(kimi_dir, "keep"), tokenizer=tok))
        strip, _ = asyncio.run(regenerate_all([url], records, mix=_mix(kimi_dir, "strip"), tokenizer=tok))
    for k, s in zip(keep, strip, strict=True):
        assert not k["error"] and not s["error"], (k["error"], s["error"])
        assert len(k["turns"]) == 2  # a tool call, then the answer to its result
        first = k["messages"][1]
        assert first["tool_calls"] and first["reasoning_content"]
        # the target saw the same prompts either way: its own reasoning stayed in the second request
        assert s["input_ids"] == k["input_ids"]
        second_prompt = tok.decode(k["input_ids"][: len(k["input_ids"]) - len(k["turns"][1]["output_ids"])])
        assert f"<think>{first['reasoning_content']}</think><|tool_calls_section_begin|>" in second_prompt
        # only the stored row loses it
        assert all(m["reasoning_content"] is None for m in s["messages"] if m["role"] == "assistant")
        assert [t["text"] for t in s["turns"]] == [t["text"] for t in k["turns"]]
