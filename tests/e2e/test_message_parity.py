"""The trainer sees exactly the messages the target saw, for every source format regen reads.

Each public sample file (../shared/samples) goes the whole way: prepare_run (read, normalize, prompt
shard), the Regenerator building its requests (api chat: the request's `messages`; api generate: what
the chat template is given), the output shard written and read back, and the trainer turning the
row into template input (train.data: table_examples' renderer input, template_messages). A fake
endpoint answers with reasoning (and tool calls where tools are offered) so the target's own turns
carry those fields too. Every request's messages must be the start of the trainer's conversation,
the trainer's conversation must be the last request's plus the target's answer, and the tools equal.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from regen_service.produce.prepare import prepare_run
from regen_service.state.storage import RunLayout, Storage
from regen_service.train.data import Example, table_examples, template_messages
from regen_service.work.client.http import Completion
from regen_service.work.regenerate import Regenerator
from schemas.conversation import ToolCall
from schemas.mix import parse_mix
from schemas.prompt_rows import prompts_from_table
from schemas.rows import output_rows, output_table
from tests.procs import SAMPLES
from tests.produce.test_samples import FILES

pytestmark = pytest.mark.skipif(not SAMPLES.is_dir(), reason=f"{SAMPLES} not present")


class FakePool:
    """Answers every request at once and records what was asked: (messages, tools) per request."""

    def __init__(self, tokenizer=None):
        self.asked: list[tuple[list[dict], list | None]] = []
        self.tokenizer = tokenizer

    async def complete(self, api: str, payload: dict, *, prompt_len: int | None = None) -> Completion:
        if api == "chat":
            self.asked.append((payload["messages"], payload.get("tools")))
            tools = payload.get("tools")
            calls = None
            if tools:
                calls = [ToolCall(id="functions.t:0", name=tools[0]["function"]["name"], arguments="{}")]
            return Completion(content="answer", reasoning_content="thought", tool_calls=calls)
        self.asked.append(self.tokenizer.last)
        return Completion(text="thought</think>answer<|im_end|>", output_ids=[7, 8, 9])


class FakeTokenizer:
    """What prompt_ids hands the chat template, kept; ids one per message."""

    last: tuple[list[dict], list | None]

    def apply_chat_template(self, messages, tools=None, **_kw):
        self.last = (messages, tools)
        return list(range(1, len(messages) + 1))


class RecordingRenderer:
    """The trainer's renderer, recording the conversation it is asked to encode."""

    def __init__(self):
        self.seen: list[tuple[list[dict], list | None]] = []

    def encode(self, messages, tools, max_length=None):
        self.seen.append((messages, tools))
        return Example(torch.tensor([1, 2]), torch.tensor([0, 1]))


def _mix(files: dict, base_dir: str, api: str, turns: str):
    sources = [
        {"name": n, "path": f, "format": fmt, "fields": fields} for n, (f, fmt, fields) in files.items()
    ]
    # the tokenizer path is only read by the worker's loader; the tests hand in FakeTokenizer
    target = {"model": "m", "api": api} | ({"tokenizer": "unused"} if api == "generate" else {})
    spec = {"name": "parity", "target": target, "sources": sources}
    return parse_mix({**spec, "regenerate": {"turns": turns}}, base_dir=base_dir)


def _regenerate(mix, tmp_path, api: str):
    """prepare -> Regenerator -> output shard on disk; (requests asked per row, rows read back)."""
    storage = Storage(str(tmp_path / "data"))
    manifest = prepare_run(mix, storage, "parity", "")
    layout = RunLayout(storage, "parity")
    records = [
        r
        for s in manifest.shards
        for r in prompts_from_table(storage.read_table(layout.prompt_shard(s.shard_id)))
    ]
    tokenizer = FakeTokenizer() if api == "generate" else None
    asked, rows = [], []

    async def go():
        for rec in records:
            pool = FakePool(tokenizer)
            rows.append(await Regenerator(pool, mix, tokenizer).regenerate(rec))
            asked.append(pool.asked)

    asyncio.run(go())
    path = layout.output_shard(0)
    storage.write_table_atomic(path, output_table(rows))
    return asked, storage.read_table(path)


def _same_conversation(asked, trained_messages, trained_tools) -> None:
    assert asked, "a conversation row made no request"
    for messages, tools in asked:
        assert trained_messages[: len(messages)] == messages
        assert trained_tools == tools
    last = asked[-1][0]
    assert len(trained_messages) == len(last) + 1 and trained_messages[-1]["role"] == "assistant"
    assert trained_messages[-1]["reasoning_content"] == "thought"


@pytest.mark.parametrize("turns", ["last", "all"])
def test_chat_requests_and_training_render_the_same_messages(tmp_path, turns):
    files = {n: (f, fmt, fields) for n, (f, fmt, fields, _) in FILES.items()}
    asked, table = _regenerate(_mix(files, str(SAMPLES), "chat", turns), tmp_path, "chat")
    renderer = RecordingRenderer()
    _, stats = table_examples(table, lambda: renderer, 64)
    assert stats["errors"] == 0 and stats["template_rows"] == table.num_rows == len(asked)
    for requests, (messages, tools) in zip(asked, renderer.seen, strict=True):
        _same_conversation(requests, messages, tools)
    sent = [m for requests in asked for messages, _ in requests for m in messages]
    # the fields the sources have reach both sides (not a vacuous comparison)
    assert any(m["role"] == "system" for m in sent)
    assert any(m["role"] == "tool" and "tool_call_id" in m for m in sent)
    assert any(m.get("tool_calls") for m in sent if m["role"] == "assistant")
    # the dataset's own reasoning is in a request only where its assistant turns stay (turns: last)
    dataset_reasoning = any(m.get("reasoning_content") not in (None, "thought") for m in sent)
    assert dataset_reasoning == (turns == "last")
    assert any(m[-1].get("tool_calls") for m, _ in renderer.seen)


def test_generate_prompts_and_training_render_the_same_messages(tmp_path):
    files = {n: (f, fmt, fields) for n, (f, fmt, fields, _) in FILES.items()}
    asked, table = _regenerate(_mix(files, str(SAMPLES), "generate", "last"), tmp_path, "generate")
    rows = output_rows(table)
    for requests, row in zip(asked, rows, strict=True):
        assert row.error is None and row.input_ids and row.loss_mask
        _same_conversation(requests, template_messages(row), json.loads(row.tools) if row.tools else None)


def test_pretokenized_rows_reach_the_trainer_as_given(tmp_path):
    data = tmp_path / "ids.jsonl"
    given = [
        {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},
        {"input_ids": [9, 10], "loss_mask": [0, 1]},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in given))
    mix = _mix({"ids": ("ids.jsonl", "pretokenized", {})}, str(tmp_path), "chat", "all")
    asked, table = _regenerate(mix, tmp_path, "chat")
    assert asked == [[], []]  # nothing to render, nothing asked
    examples, stats = table_examples(table, lambda: pytest.fail("no template"), 64)
    assert stats["token_rows"] == 2 and [r.messages for r in output_rows(table)] == [None, None]
    got = sorted((e.ids.tolist(), e.mask.tolist()) for e in examples)
    assert got == sorted((r["input_ids"], r["loss_mask"]) for r in given)
