"""Normalizers: each format's mapping onto schemas.Conversation, and the RowError reasons for bad rows."""

from __future__ import annotations

import json

import pytest

from regen_service.produce.sources import RowError, normalize_row
from schemas.conversation import compute_prompt_id
from schemas.mix import SourceSpec


def spec(fmt: str, **kw) -> SourceSpec:
    return SourceSpec(name="s", path="x.jsonl", format=fmt, **kw)


def roles(rec) -> list[str]:
    return [m.role for m in rec.conversation.messages]


def reason(fmt: str, raw, **kw) -> str:
    with pytest.raises(RowError) as err:
        normalize_row(spec(fmt, **kw), raw, 0)
    return err.value.reason


def test_sharegpt_roles_system_and_function_call():
    raw = {
        "system": "Be terse.",
        "tools": json.dumps([{"name": "lookup", "parameters": {"type": "object"}}]),
        "conversations": [
            {"from": "human", "value": "Find x."},
            {"from": "gpt", "value": "Looking."},
            {"from": "function_call", "value": json.dumps({"name": "lookup", "arguments": {"q": "x"}})},
            {"from": "function_call", "value": '{"name": "lookup", "arguments": "{\\"q\\": \\"y\\"}"}'},
            {"from": "observation", "value": '{"x": 1}'},
            {"from": "observation", "value": '{"y": 2}'},
            {"from": "chatgpt", "value": "x is 1."},
        ],
    }
    rec = normalize_row(spec("sharegpt"), raw, 3)
    assert roles(rec) == ["system", "user", "assistant", "tool", "tool", "assistant"]
    calls = rec.conversation.messages[2].tool_calls
    assert rec.conversation.messages[2].content == "Looking."
    assert [(c.name, c.arguments) for c in calls] == [("lookup", '{"q": "x"}'), ("lookup", '{"q": "y"}')]
    assert [m.name for m in rec.conversation.messages[3:5]] == ["lookup", "lookup"]
    assert rec.conversation.tools == (
        {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},
    )
    assert rec.row_index == 3 and rec.source == "s"
    assert rec.prompt_id == compute_prompt_id(rec.conversation)


def test_function_call_without_preceding_assistant_opens_a_turn():
    raw = {
        "conversations": [
            {"from": "human", "value": "hi"},
            {"from": "function_call", "value": '{"name": "f"}'},
        ]
    }
    rec = normalize_row(spec("sharegpt"), raw, 0)
    m = rec.conversation.messages[1]
    assert (m.role, m.content, m.tool_calls[0].arguments) == ("assistant", "", "{}")


def test_messages_tool_calls_parts_and_role_aliases():
    raw = {
        "messages": [
            {"role": "developer", "content": "\nsys\n"},
            {"role": "user", "content": [{"type": "image", "image": "u"}, {"type": "text", "text": "看这个"}]},
            {"role": "assistant", "content": None, "reasoning_content": "r", "loss": False,
             "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": "北京"}}}]},
            {"role": "function", "content": "ok"},
            {"role": "assistant", "content": "done"},
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }  # fmt: skip
    rec = normalize_row(spec("messages"), raw, 0)
    msgs = rec.conversation.messages
    assert roles(rec) == ["system", "user", "assistant", "tool", "assistant"]
    assert msgs[0].content == "\nsys\n"  # verbatim
    assert msgs[1].content == "看这个" and rec.num_dropped_parts == 1
    assert msgs[2].tool_calls[0].arguments == '{"a": "北京"}' and msgs[2].reasoning_content == "r"
    assert msgs[3].name == "f" and msgs[3].tool_call_id is None


def test_instruction_and_prompt_response():
    rec = normalize_row(
        spec("instruction"), {"instruction": "Sum.", "input": "1 2", "output": "3", "system": "S"}, 0
    )
    assert [(m.role, m.content) for m in rec.conversation.messages] == [
        ("system", "S"),
        ("user", "Sum.\n\n1 2"),
        ("assistant", "3"),
    ]
    rec = normalize_row(spec("instruction"), {"instruction": "Hi.", "input": ""}, 0)
    assert [(m.role, m.content) for m in rec.conversation.messages] == [("user", "Hi.")]
    rec = normalize_row(
        spec("prompt_response", fields={"response": "completion"}),
        {"prompt": "Q\n", "completion": "A<|endoftext|>"},
        0,
    )
    assert [(m.role, m.content) for m in rec.conversation.messages] == [("user", "Q\n"), ("assistant", "A")]


def test_pretokenized_passthrough_and_id():
    rec = normalize_row(spec("pretokenized"), {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, 0)
    assert rec.conversation is None and rec.input_ids == [5, 6, 7]
    assert rec.prompt_id == compute_prompt_id(None, [5, 6, 7])


def test_field_renames_top_level_and_turn_keys():
    raw = {"dialog": [{"speaker": "user", "text": "hey"}]}
    rec = normalize_row(
        spec("sharegpt", fields={"conversations": "dialog", "from": "speaker", "value": "text"}), raw, 0
    )
    assert rec.conversation.messages[0].content == "hey"


def test_same_content_same_id_across_formats():
    a = normalize_row(spec("instruction"), {"instruction": "Q", "output": "A"}, 0)
    b = normalize_row(spec("prompt_response"), {"prompt": "Q", "response": "A"}, 9)
    c = normalize_row(
        spec("sharegpt"),
        {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]},
        1,
    )
    assert a.prompt_id == b.prompt_id == c.prompt_id


@pytest.mark.parametrize(
    ("fmt", "raw", "expected"),
    [
        ("sharegpt", {"conversations": [{"from": "narrator", "value": "x"}]}, "conversations[0].from: unknown role 'narrator' (allowed: human"),
        ("sharegpt", {"conversations": []}, "conversations: empty conversation"),
        ("sharegpt", {"conversations": "hi"}, "conversations: expected a list of turns, got str"),
        ("sharegpt", {"id": 1}, "conversations: missing"),
        ("sharegpt", {"conversations": [{"from": "gpt", "value": "x"}]}, "no user turn"),
        ("sharegpt", {"conversations": [{"from": "human", "value": 3}]}, "conversations[0].value: expected a string"),
        ("sharegpt", {"conversations": [{"from": "human", "value": "a\ud800b"}]}, "conversations[0].value: invalid text (unpaired surrogate"),
        ("sharegpt", {"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "nope"}]}, "conversations[1].value: a function_call value must be JSON"),
        ("sharegpt", {"conversations": [{"from": "human", "value": "q"}], "tools": "[oops"}, "tools: a string that is not valid JSON"),
        ("messages", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role: unknown role 'robot'"),
        ("messages", {"messages": [{"role": "user"}]}, "messages[0].content: missing"),
        ("messages", {"messages": [{"role": "user", "content": [{"type": "image", "image": "u"}]}]}, "only non-text parts"),
        ("messages", {"messages": [{"role": "user", "content": "q", "tool_calls": [{"function": {"arguments": "{}"}}]}]}, "only assistant messages can call tools"),
        ("messages", {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}]}, "messages[1].tool_calls[0].function.name"),
        ("instruction", {"input": "x"}, "instruction: missing"),
        ("instruction", {"instruction": "", "input": ""}, "empty instruction and input"),
        ("prompt_response", {"prompt": None}, "prompt: expected a string, got null"),
        ("prompt_response", {"prompt": "q", "completion": "a"}, "add `fields: {response: completion}`"),
        ("pretokenized", {"input_ids": [1, "2"], "loss_mask": [1, 1]}, "input_ids[1]: expected an int, got str"),
        ("pretokenized", {"input_ids": [1, True], "loss_mask": [1, 1]}, "input_ids[1]: expected an int, got bool"),
        ("pretokenized", {"input_ids": [1, 2], "loss_mask": [1]}, "loss_mask: length 1 differs"),
        ("pretokenized", {"input_ids": [1, 2**40], "loss_mask": [1, 1]}, "out of range"),
        ("pretokenized", {"input_ids": [1], "loss_mask": [2]}, "loss_mask: values must be 0 or 1"),
        ("pretokenized", {"loss_mask": [1]}, "input_ids: missing"),
    ],
)  # fmt: skip
def test_bad_rows_name_the_field(fmt, raw, expected):
    assert expected in reason(fmt, raw)


def test_non_dict_row_is_a_row_error():
    assert "expected an object, got list" in reason("messages", [{"role": "user", "content": "x"}])
