"""One training sample per generation on the scaled-down Kimi-K2.5 folder: every trained token is a
token the target produced in exactly that context.

Rows come from the real path (regenerate against the simulator serving the Kimi fixture over HTTP,
written to Parquet and read back); the check asks the simulator again, without streaming, for each
sample's prompt: its answer must be the sample's trained tokens (answers are a pure function of the
prompt, as a greedy target's would be)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from regen_service.kimi_fixture import build_kimi_fixture
from regen_service.remote_code import load_tokenizer
from regen_service.state.storage import Storage
from regen_service.train.data import ChatRenderer, table_examples
from schemas.conversation import Message
from schemas.mix import MixSpec
from schemas.rows import OutputRow, output_table
from tests.procs import sim_server
from tests.work.test_client_faults import FAST, MODEL, make_record, regenerate_all


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    return build_kimi_fixture(tmp_path_factory.mktemp("kimi") / "Kimi-K2.5")


@pytest.fixture(scope="module")
def kimi_tok(kimi_dir):
    return load_tokenizer(kimi_dir, trust_remote_code=True, setting="test")


def _mix(kimi_dir, api: str) -> MixSpec:
    target = {"model": MODEL, "api": api, "tokenizer": str(kimi_dir), "trust_remote_code": True}
    return MixSpec.model_validate(
        {
            "name": "t",
            "target": target,
            "sampling": {"max_new_tokens": 64},
            "sources": [{"name": "s", "path": "x.jsonl", "format": "messages"}],
        }
    )


def _records(n: int):
    turns = []
    for q in ("first question", "second question", "third question"):
        turns += [Message(role="user", content=q), Message(role="assistant", content="old answer")]
    return [make_record(i, [Message(role="user", content=f"topic {i}"), *turns[1:]]) for i in range(n)]


TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
)


def _tool_records(n: int):
    """A tool task, its answer, then a new question: the last prompt drops the task's thinking."""
    from schemas.conversation import ToolCall

    call = ToolCall(id="c1", name="get_weather", arguments='{"city": "Oslo"}')
    msgs = [
        Message(role="user", content="weather?"),
        Message(role="assistant", content="", tool_calls=(call,)),
        Message(role="tool", tool_call_id="c1", content="rain"),
        Message(role="assistant", content="Rain."),
        Message(role="user", content="and tomorrow?"),
    ]
    return [
        make_record(i, [Message(role="user", content=f"city {i}"), *msgs[1:]], tools=TOOLS) for i in range(n)
    ]


def _roundtrip(tmp_path, rows):
    storage = Storage(str(tmp_path / "data"))
    path = storage.path("outputs", "shard-00000.parquet")
    storage.write_table_atomic(path, output_table(OutputRow.from_record(r) for r in rows))
    return storage.read_table(path)


@pytest.mark.parametrize("tools", [False, True], ids=["chat-turns", "tool-task"])
def test_every_trained_token_was_produced_in_exactly_that_context(kimi_dir, kimi_tok, tmp_path, tools):
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
    records = _tool_records(3) if tools else _records(3)
    with sim_server(*FAST, *args) as url:
        rows, _ = asyncio.run(
            regenerate_all([url], records, mix=_mix(kimi_dir, "generate"), tokenizer=kimi_tok)
        )
        assert all(len(r["turns"]) == 3 and not r["error"] for r in rows)
        # a prompt the final one re-rendered (the tool task's thinking dropped) is stored; others are not
        stored = [t["prompt_ids"] is not None for t in rows[0]["turns"]]
        assert stored == [False, tools, False]
        table = _roundtrip(tmp_path, rows)
        renderer = ChatRenderer(kimi_tok)
        assert renderer.drops_thinking  # Kimi's template: so auto means per generation
        per_gen, stats = table_examples(table, lambda: renderer, 4096, "per_generation")
        assert stats["generation_samples"] == len(per_gen) == 3 * 3
        outputs = [t["output_ids"] for r in rows for t in r["turns"]]
        for ex, out in zip(per_gen, outputs, strict=True):
            ids, mask = ex.ids.tolist(), ex.mask.tolist()
            n = mask.index(1)
            assert ids[n:] == out and all(mask[n:]) and not any(mask[:n])
            body = {"input_ids": ids[:n], "sampling_params": {"max_new_tokens": 64}}
            again = httpx.post(f"{url}/generate", json=body, timeout=30).json()
            assert again["output_ids"] == ids[n:]  # the target's answer to exactly this prompt
    # one rendering of the finished conversation lost the earlier turns' thinking: their tokens were
    # not the target's there, so the conversation sample trains only the last answer
    whole, _ = table_examples(table, lambda: renderer, 4096, "conversation")
    assert sum(int(e.mask.sum()) for e in whole) < sum(int(e.mask.sum()) for e in per_gen)
    assert sum(int(e.mask.sum()) for e in per_gen) == sum(len(o) for o in outputs)


def test_chat_rows_are_rendered_per_generation(kimi_dir, kimi_tok, tmp_path):
    args = ("--tokenizer", str(kimi_dir), "--trust-remote-code", "--decode-tok-s", "0", "--think-prob", "1")
    with sim_server(*FAST, *args) as url:
        rows, _ = asyncio.run(regenerate_all([url], _records(2), mix=_mix(kimi_dir, "chat"), tokenizer=None))
    table = _roundtrip(tmp_path, rows)
    renderer = ChatRenderer(kimi_tok)
    examples, stats = table_examples(table, lambda: renderer, 4096, "per_generation")
    assert stats["generation_samples"] == len(examples) == 2 * 3
    turns = [(t, r["messages"][t["message_index"]]) for r in rows for t in r["turns"]]
    for ex, (turn, msg) in zip(examples, turns, strict=True):
        ids, mask = ex.ids.tolist(), ex.mask.tolist()
        n = mask.index(1)
        assert n == turn["prompt_tokens"]  # the prompt the server counted
        assert kimi_tok.decode(ids[:n]).endswith("<|im_assistant|>assistant<|im_middle|><think>")
        want = f"{msg['reasoning_content']}</think>{msg['content']}<|im_end|>"
        assert kimi_tok.decode(ids[n:]) == want


def test_auto_keeps_conversation_samples_for_templates_that_keep_thinking():
    from transformers import AutoTokenizer

    from regen_service.train.fixtures import DEMO_TOKENIZER

    tok = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    assert ChatRenderer(tok).drops_thinking  # the demo template is Kimi-style
    tok.chat_template = (
        "{%- for m in messages -%}<|im_user|>{{ m['role'] }}<|im_middle|>"
        "{%- if m.get('reasoning_content') -%}<think>{{ m['reasoning_content'] }}</think>{%- endif -%}"
        "{{ m['content'] }}<|im_end|>{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_user|>assistant<|im_middle|>{%- endif -%}"
    )
    assert not ChatRenderer(tok).drops_thinking


def test_rows_written_before_per_turn_prompts_train_as_a_whole(tmp_path):
    row = {
        "prompt_id": "p",
        "input_ids": [1, 2, 3, 4, 5],
        "loss_mask": [0, 0, 0, 1, 1],
        "turns": [{"message_index": 1, "output_ids": [4, 5], "text": "x"}],  # no prompt_len
    }
    examples, stats = table_examples(
        output_table([OutputRow.from_record(row)]), lambda: None, 64, "per_generation"
    )
    assert [e.mask.tolist() for e in examples] == [[0, 0, 0, 1, 1]] and stats["generation_samples"] == 0
