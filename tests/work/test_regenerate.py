"""Regenerator against the simulator: both APIs x stream/non-stream, exact output_ids, thinking modes,
multi-turn (all / last), tool results kept in place, pretokenized passthrough."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from transformers import AutoTokenizer

from regen_service.work.client.pool import EndpointPool
from regen_service.work.regenerate import Regenerator
from schemas.conversation import Message, PromptRecord, ToolCall
from schemas.tables import OUTPUT_SCHEMA
from tests.procs import sim_server
from tests.work.test_client_faults import (
    FAST,
    MODEL,
    assert_all_answered,
    fast_config,
    make_mix,
    make_record,
    regenerate_all,
    simple_records,
)
from tests.work.test_client_units import DEMO_TOKENIZER

TOK_ARGS = ("--tokenizer", str(DEMO_TOKENIZER), "--decode-tok-s", "0")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(DEMO_TOKENIZER))


def _mix(api: str, **kw):
    return make_mix(api=api, tokenizer=str(DEMO_TOKENIZER) if api == "generate" else None, **kw)


def _run(url, records, api, tok, **kw):
    mix_kw = {k: kw.pop(k) for k in ("turns", "thinking") if k in kw}
    rows, _ = asyncio.run(regenerate_all([url], records, mix=_mix(api, **mix_kw), tokenizer=tok, **kw))
    return rows


@pytest.mark.parametrize("api", ["chat", "generate"])
def test_both_apis_stream_and_non_stream_agree(api, tok):
    records = simple_records(12)
    with sim_server(*FAST, *TOK_ARGS, "--think-prob", "0.5") as url:
        streamed = _run(url, records, api, tok, stream=True)
        whole = _run(url, records, api, tok, stream=False)
    with sim_server(*FAST, *TOK_ARGS, "--think-prob", "0.5", "--incremental-streaming-output") as url:
        incremental = _run(url, records, api, tok, stream=True)  # mode from /server_info
    for rows in (streamed, whole, incremental):
        assert_all_answered(rows, 12)
    key = [
        (r["messages"], [t["text"] for t in r["turns"]], [t["output_ids"] for t in r["turns"]])
        for r in streamed
    ]
    assert key == [
        (r["messages"], [t["text"] for t in r["turns"]], [t["output_ids"] for t in r["turns"]]) for r in whole
    ]
    assert key == [
        (r["messages"], [t["text"] for t in r["turns"]], [t["output_ids"] for t in r["turns"]])
        for r in incremental
    ]
    turn = streamed[0]["turns"][0]
    assert turn["ttft_s"] is not None and turn["latency_s"] > 0 and turn["completion_tokens"] > 0
    assert any(r["messages"][-1]["reasoning_content"] for r in streamed)
    # every row fits the output table the worker writes
    import pyarrow as pa

    pa.Table.from_pylist([r | {"run_id": "r", "reused_from": None} for r in streamed], schema=OUTPUT_SCHEMA)


def test_generate_keeps_the_exact_output_ids(tok):
    records = simple_records(10)
    with sim_server(*FAST, *TOK_ARGS, "--think-prob", "0.5", "--tool-call-prob", "0") as url:
        rows = _run(url, records, "generate", tok)
        for row in rows:
            turn = row["turns"][0]
            n_out = len(turn["output_ids"])
            prompt = row["input_ids"][: len(row["input_ids"]) - n_out]
            assert row["input_ids"][len(prompt) :] == turn["output_ids"]
            assert row["loss_mask"] == [0] * len(prompt) + [1] * n_out
            direct = httpx.post(
                f"{url}/generate",
                json={
                    "input_ids": prompt,
                    "sampling_params": {"max_new_tokens": 256, "skip_special_tokens": False},
                },
            ).json()
            assert direct["output_ids"] == turn["output_ids"]
            assert direct["text"] == turn["text"]
            assert tok.decode(prompt) == tok.apply_chat_template(
                [
                    {
                        "role": "user",
                        "content": records[int(row["prompt_id"][1:])].conversation.messages[0].content,
                    }
                ],
                add_generation_prompt=True,
                tokenize=False,
                thinking=True,
            )


@pytest.mark.parametrize("api", ["chat", "generate"])
def test_thinking_keep_strip_off(api, tok):
    records = simple_records(6)
    with sim_server(*FAST, *TOK_ARGS, "--think-prob", "1", "--tool-call-prob", "0") as url:
        keep = _run(url, records, api, tok, thinking="keep")
        strip = _run(url, records, api, tok, thinking="strip")
        off = _run(url, records, api, tok, thinking="off")
    for k, s, o in zip(keep, strip, off, strict=True):
        km, sm, om = k["messages"][-1], s["messages"][-1], o["messages"][-1]
        assert km["reasoning_content"] and "</think>" in k["turns"][0]["text"]
        assert k["turns"][0]["text"].endswith(km["content"]) or km["content"] in k["turns"][0]["text"]
        assert sm["reasoning_content"] is None and sm["content"] == km["content"]
        assert s["turns"][0]["text"] == k["turns"][0]["text"]  # turn text stays raw
        assert om["reasoning_content"] is None and "</think>" not in o["turns"][0]["text"]


def test_chat_without_reasoning_parser_is_split_client_side():
    records = simple_records(6)
    with sim_server(*FAST, *TOK_ARGS, "--think-prob", "1", "--tool-call-prob", "0") as url:
        parsed = _run(url, records, "chat", None)
    with sim_server(
        *FAST, *TOK_ARGS, "--think-prob", "1", "--tool-call-prob", "0", "--reasoning-parser", "none"
    ) as url:
        raw = _run(url, records, "chat", None)
    assert [r["messages"][-1] for r in raw] == [r["messages"][-1] for r in parsed]


def _multi_turn(i: int) -> PromptRecord:
    return make_record(
        i,
        [
            Message(role="system", content="be brief"),
            Message(role="user", content=f"first question {i}"),
            Message(role="assistant", content="DATASET ANSWER ONE"),
            Message(role="user", content=f"second question {i}"),
            Message(role="assistant", content="DATASET ANSWER TWO"),
        ],
    )


@pytest.mark.parametrize("api", ["chat", "generate"])
def test_multi_turn_all_and_last(api, tok):
    records = [_multi_turn(i) for i in range(4)]
    open_end = [make_record(9, [Message(role="user", content="q1"), Message(role="assistant", content="DATASET"),
                                Message(role="user", content="q2")])]  # fmt: skip
    with sim_server(*FAST, *TOK_ARGS, "--think-prob", "0", "--tool-call-prob", "0") as url:
        all_rows = _run(url, records + open_end, api, tok, turns="all")
        last_rows = _run(url, records + open_end, api, tok, turns="last")
    for row in all_rows[:4]:
        assert [t["message_index"] for t in row["turns"]] == [2, 4]
        assert "DATASET" not in json.dumps(row["messages"])
        if api == "generate":  # the second prompt carries the target's first answer, token for token
            first = row["turns"][0]["output_ids"]
            assert sum(row["loss_mask"]) >= len(row["turns"][1]["output_ids"])
            assert any(row["input_ids"][j : j + len(first)] == first for j in range(len(row["input_ids"])))
    for row in last_rows[:4]:
        assert [t["message_index"] for t in row["turns"]] == [4]
        assert row["messages"][2]["content"] == "DATASET ANSWER ONE"
    # ends with a user turn: a new assistant turn is appended
    assert [t["message_index"] for t in all_rows[4]["turns"]] == [1, 3] and len(all_rows[4]["messages"]) == 4
    assert [t["message_index"] for t in last_rows[4]["turns"]] == [3] and last_rows[4]["messages"][1][
        "content"
    ] == "DATASET"


def _tool_conversation(i: int) -> PromptRecord:
    call = ToolCall(id="call_dataset_0", name="get_weather", arguments='{"city": "Paris"}')
    return make_record(
        i,
        [
            Message(role="user", content=f"weather in Paris? {i}"),
            Message(role="assistant", content="", tool_calls=(call,)),
            Message(role="tool", content='{"temp_c": 21}', tool_call_id="call_dataset_0", name="get_weather"),
            Message(role="assistant", content="DATASET FINAL"),
        ],
        tools=(WEATHER,),
    )


@pytest.mark.parametrize("api", ["chat", "generate"])
def test_tool_results_kept_after_regenerated_tool_call(api, tok):
    records = [_tool_conversation(i) for i in range(3)]
    with sim_server(*FAST, *TOK_ARGS, "--tool-call-prob", "1") as url:
        rows = _run(url, records, api, tok)
    with sim_server(*FAST, *TOK_ARGS, "--tool-call-prob", "0") as url:
        no_call = _run(url, records, api, tok)
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["user", "assistant", "tool", "assistant"] and not row["error"]
        call = row["messages"][1]["tool_calls"][0]
        assert call["name"] == "get_weather" and json.loads(call["arguments"]) is not None
        assert (
            row["messages"][2]["content"] == '{"temp_c": 21}'
            and row["messages"][2]["tool_call_id"] == call["id"]
        )
        assert row["messages"][3]["content"] != "DATASET FINAL" and len(row["turns"]) == 2
    for row in no_call:  # the target answered without the tool: the row ends with its answer
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"] and len(row["turns"]) == 1


def test_pretokenized_rows_pass_through_without_a_request():
    rec = PromptRecord(prompt_id="x", source="s", row_index=0, input_ids=[1, 2, 3], loss_mask=[0, 1, 1])

    async def go(url):
        async with EndpointPool(fast_config([url]), MODEL) as pool:
            return (await Regenerator(pool, make_mix()).regenerate(rec)).to_record()

    with sim_server(*FAST) as url:
        row = asyncio.run(go(url))
        assert httpx.get(f"{url}/sim/stats").json()["requests_total"] == 0
    assert row["input_ids"] == [1, 2, 3] and row["loss_mask"] == [0, 1, 1] and row["turns"] == []


def test_a_prompt_with_images_is_refused_with_its_reason_and_sends_nothing():
    from schemas.conversation import Conversation
    from schemas.media import ImageRef

    ref = ImageRef(offset=0, sha256="a" * 64, media_type="image/png", width=2, height=2, num_bytes=70)
    conv = Conversation(messages=(Message(role="user", content="What is it?", images=(ref,)),))
    rec = PromptRecord(prompt_id="img", source="s", row_index=0, conversation=conv)

    async def go(url):
        async with EndpointPool(fast_config([url]), MODEL) as pool:
            return (await Regenerator(pool, make_mix()).regenerate(rec)).to_record()

    with sim_server(*FAST) as url:
        row = asyncio.run(go(url))
        assert httpx.get(f"{url}/sim/stats").json()["requests_total"] == 0
    assert row["error_class"] == "terminal_row" and "1 image part(s)" in row["error"]
    assert row["turns"] == [] and row["messages"] == []  # nothing answered: nothing to train on
