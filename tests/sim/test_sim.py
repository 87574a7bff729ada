"""The simulator's HTTP surface, over real HTTP to `regen sim` processes: shapes, determinism, tokenizer.

Faults, outages, the capacity model and speculative mode are in test_sim_faults.py.
"""

from __future__ import annotations

import itertools
import json

import httpx
import pytest

from tests.procs import sim_server

ANSWER_FLAGS = (
    "--answer-len-mean",
    "40",
    "--answer-len-max",
    "120",
    "--think-prob",
    "0.5",
    "--tool-call-prob",
    "0.5",
)
FAST = ("--decode-tok-s", "2000", "--tick-s", "0.005")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


def sse(url: str, body: dict, headers: dict | None = None) -> list:
    """POST and read an SSE stream: parsed JSON events, and the string "[DONE]" where it came."""
    events = []
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def chat(messages, **extra) -> dict:
    return {"messages": messages, **extra}


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def sim():
    with sim_server(*FAST, *ANSWER_FLAGS, "--context-length", "500", "--seed", "3") as url:
        yield url


def test_generate_json_and_cumulative_stream(sim):
    body = {"text": "Tell me about the sea.", "sampling_params": {"max_new_tokens": 64, "temperature": 0.7}}
    r = httpx.post(f"{sim}/generate", json=body, timeout=30)
    assert r.status_code == 200
    out = r.json()
    meta = out["meta_info"]
    assert set(meta) >= {
        "id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "e2e_latency",
    }
    assert meta["completion_tokens"] == len(out["output_ids"]) > 0
    assert meta["finish_reason"]["type"] in ("stop", "length")
    if meta["finish_reason"]["type"] == "length":
        assert meta["finish_reason"]["length"] == 64

    events = sse(f"{sim}/generate", {**body, "stream": True, "rid": "abc"})
    assert events[-1] == "[DONE]"
    data = events[:-1]
    for prev, cur in itertools.pairwise(data):
        assert cur["text"].startswith(prev["text"])  # cumulative
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert prev["meta_info"]["finish_reason"] is None
    assert data[-1]["text"] == out["text"] and data[-1]["output_ids"] == out["output_ids"]
    assert data[-1]["meta_info"]["finish_reason"] == meta["finish_reason"]
    assert data[-1]["meta_info"]["id"] == "abc"


def test_generate_thinking_follows_the_prompt_ending(sim):
    for i in range(12):
        opened = httpx.post(f"{sim}/generate", json={"text": f"q{i}<think>"}, timeout=30).json()
        assert "<think>" not in opened["text"]
        if opened["meta_info"]["finish_reason"]["type"] == "stop":
            assert "</think>" in opened["text"]
        closed = httpx.post(f"{sim}/generate", json={"text": f"q{i}<think></think>"}, timeout=30).json()
        assert "think>" not in closed["text"]


def test_generate_batch(sim):
    r = httpx.post(f"{sim}/generate", json={"text": ["a b", "c d"], "sampling_params": {"max_new_tokens": 5}})
    assert r.status_code == 200
    assert [len(x["output_ids"]) <= 5 for x in r.json()] == [True, True]


def test_chat_json_reasoning_and_tool_calls(sim):
    seen = {"reasoning": 0, "tool_calls": 0, "stop": 0}
    for i in range(16):
        r = httpx.post(
            f"{sim}/v1/chat/completions", json=chat(user(f"weather {i}?"), tools=TOOLS), timeout=30
        )
        assert r.status_code == 200
        out = r.json()
        assert all(c in "0123456789abcdef" for c in out["id"])
        choice = out["choices"][0]
        msg = choice["message"]
        assert msg["role"] == "assistant"
        usage = out["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        if msg["reasoning_content"]:
            seen["reasoning"] += 1
            assert usage["reasoning_tokens"] > 0 and "</think>" not in (msg["content"] or "")
        if choice["finish_reason"] == "tool_calls":
            seen["tool_calls"] += 1
            call = msg["tool_calls"][0]
            assert call["type"] == "function" and call["function"]["name"] == "get_weather"
            assert "city" in json.loads(call["function"]["arguments"])
        elif choice["finish_reason"] == "stop":
            seen["stop"] += 1
            assert msg["tool_calls"] is None and msg["content"]
    assert all(seen.values()), seen

    # thinking off: no reasoning at all; the last turn a tool result: no tool call
    for i in range(8):
        history = [
            *user("weather?"),
            {"role": "assistant", "content": "checking"},
            {"role": "tool", "content": f"{i}"},
        ]
        body = chat(history, tools=TOOLS, chat_template_kwargs={"thinking": False})
        msg = httpx.post(f"{sim}/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert msg["reasoning_content"] is None and msg["tool_calls"] is None


def test_chat_stream_shape(sim):
    for i in range(6):
        body = chat(user(f"explain {i}"), max_completion_tokens=80, max_tokens=5)
        whole = httpx.post(f"{sim}/v1/chat/completions", json=body, timeout=30).json()
        events = sse(
            f"{sim}/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
        )
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:-1])
        usage_chunk, final = chunks[-1], chunks[-2]
        assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
        assert (
            final["choices"][0]["delta"] == {}
            and final["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
        )
        deltas = [c["choices"][0]["delta"] for c in chunks[1:-2]]
        kinds = ["r" if "reasoning_content" in d else "c" for d in deltas]
        assert kinds == sorted(kinds, key=lambda k: k == "c"), "reasoning deltas come first"
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        content = "".join(d.get("content", "") for d in deltas)
        msg = whole["choices"][0]["message"]
        assert reasoning == (msg["reasoning_content"] or "") and content == msg["content"]
        assert whole["usage"]["completion_tokens"] <= 80

    no_usage = sse(f"{sim}/v1/chat/completions", {**chat(user("x")), "stream": True})
    assert all(c == "[DONE]" or c["choices"] for c in no_usage)


def test_context_length_errors_in_three_shapes(sim):
    long_text = "word " * 600
    msg = "The input (600 tokens) is longer than the model's context length (500 tokens)."
    r = httpx.post(f"{sim}/generate", json={"text": long_text})
    assert r.status_code == 400 and r.json() == {"error": {"message": msg}}
    events = sse(f"{sim}/generate", {"text": long_text, "stream": True})
    assert events == [{"error": {"message": msg}}, "[DONE]"]
    ids = httpx.post(f"{sim}/generate", json={"input_ids": list(range(2000, 2600))})
    assert ids.status_code == 400 and ids.json()["error"]["message"] == msg
    for stream in (False, True):
        r = httpx.post(f"{sim}/v1/chat/completions", json={**chat(user(long_text)), "stream": stream})
        assert r.status_code == 400
        body = r.json()
        assert body["object"] == "error" and body["type"] == "BadRequestError" and body["code"] == 400
        assert (
            body["param"] is None
            and "is longer than the model's context length (500 tokens)" in body["message"]
        )


def test_info_endpoints(sim):
    assert httpx.get(f"{sim}/health").status_code == 200
    assert httpx.get(f"{sim}/health_generate").content == b""
    for path in ("/get_model_info", "/model_info"):
        info = httpx.get(f"{sim}{path}").json()
        assert info["is_generation"] is True and info["model_path"] == "moonshotai/Kimi-K2.5"
    for path in ("/get_server_info", "/server_info"):
        info = httpx.get(f"{sim}{path}").json()
        assert info["context_length"] == 500 and info["max_running_requests"] == 64
        assert info["max_req_input_len"] == 499 and "version" in info and "max_total_num_tokens" in info
        assert "avg_spec_accept_length" not in info["internal_states"][0]
        assert info["sim"]["capacity_tok_s"] == pytest.approx(64 * 2000 / (1 + 0.01 * 63), rel=1e-3)
    models = httpx.get(f"{sim}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["max_model_len"] == 500
    metrics = httpx.get(f"{sim}/metrics").text
    for name in (
        "sglang:gen_throughput",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:generation_tokens_total",
    ):
        assert f"\n{name}{{" in metrics
    assert "sglang:e2e_request_latency_seconds_bucket" in metrics


def test_incremental_stream_and_determinism_across_processes(sim):
    prompts = [f"prompt number {i} about rivers" for i in range(5)]
    convs = [chat(user(p), tools=TOOLS) for p in prompts]
    first = [httpx.post(f"{sim}/generate", json={"text": p}).json() for p in prompts]
    first_chat = [httpx.post(f"{sim}/v1/chat/completions", json=c).json() for c in convs]
    with sim_server(
        *FAST, *ANSWER_FLAGS, "--context-length", "500", "--seed", "3", "--incremental-streaming-output"
    ) as other:
        for p, f, c, fc in zip(prompts, first, convs, first_chat, strict=True):
            again = httpx.post(f"{other}/generate", json={"text": p}).json()
            assert (again["text"], again["output_ids"]) == (f["text"], f["output_ids"])
            assert httpx.post(f"{other}/v1/chat/completions", json=c).json()["choices"] == fc["choices"]
            events = sse(f"{other}/generate", {"text": p, "stream": True})[:-1]
            assert "".join(e["text"] for e in events) == f["text"]
            assert [i for e in events for i in e["output_ids"]] == f["output_ids"]
            assert events[-1]["meta_info"]["completion_tokens"] == len(f["output_ids"])
    with sim_server("--decode-tok-s", "0", *ANSWER_FLAGS, "--seed", "4") as third:
        differ = [httpx.post(f"{third}/generate", json={"text": p}).json()["output_ids"] for p in prompts]
        assert differ != [f["output_ids"] for f in first]


def test_api_key():
    with sim_server("--decode-tok-s", "0", "--api-key", "sekrit") as url:
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200
        for method, path in (
            ("POST", "/generate"),
            ("GET", "/get_server_info"),
            ("GET", "/v1/models"),
            ("GET", "/sim/stats"),
        ):
            r = httpx.request(method, f"{url}{path}", json={"text": "x"})
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
        ok = httpx.post(f"{url}/generate", json={"text": "x"}, headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200
        bad = httpx.post(f"{url}/generate", json={"text": "x"}, headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401


KIMI_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}<|im_{{ m.role if m.role in ['user', 'assistant'] else 'system' }}|>"
    "{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}{%- endif -%}"
)
SPECIALS = [
    "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<think>", "</think>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = ["the model answers the question about the river", "a draft model learns from the target"] * 20
    tk.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>")
    fast.chat_template = KIMI_TEMPLATE
    path = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(path)
    return path, fast


def test_hf_tokenizer_ids_decode_to_text(tiny_tokenizer):
    path, tok = tiny_tokenizer
    with sim_server("--decode-tok-s", "0", *ANSWER_FLAGS, "--tokenizer", str(path)) as url:
        im_end = tok.convert_tokens_to_ids("<|im_end|>")
        for i in range(6):
            for body in ({"text": f"the river {i}<think>"}, {"input_ids": tok.encode(f"the model {i}")}):
                out = httpx.post(f"{url}/generate", json=body).json()
                assert tok.decode(out["output_ids"]) == out["text"]
                if out["meta_info"]["finish_reason"]["type"] == "stop":
                    assert out["meta_info"]["finish_reason"]["matched"] == im_end
            events = sse(f"{url}/generate", {"text": f"q {i}", "stream": True})
            assert tok.decode(events[-2]["output_ids"]) == events[-2]["text"]
            messages = user(f"the question {i}")
            r = httpx.post(f"{url}/v1/chat/completions", json=chat(messages, tools=TOOLS)).json()
            prompt = tok.apply_chat_template(
                messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
            )
            expected = len(tok.encode(prompt, add_special_tokens=False))
            assert r["usage"]["prompt_tokens"] == expected
        assert httpx.get(f"{url}/get_model_info").json()["tokenizer_path"] == str(path)
