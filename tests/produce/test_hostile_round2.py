"""Issue 18, item 9 (operator's sharp edges) in produce: a user turn with nothing in it is quarantined
with its reason in every chat format, never sent as an empty prompt; and `regen demo`'s summary counts
pretokenized rows as passed through, not answered."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from regen_service.produce.prepare import prepare_run, run_id_for
from regen_service.state.storage import RunLayout, Storage
from schemas.mix import load_mix
from schemas.prompt_rows import prompts_from_table

DEMO = Path(__file__).resolve().parents[2] / "regen_service" / "demo"


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path.name


def _user(content) -> dict:
    return {"role": "user", "content": content}


# (row, the part of the reason that must name it); row indexes follow list order
SHAREGPT = [
    ({"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}]}, None),
    ({"conversations": [{"from": "human", "value": None}, {"from": "gpt", "value": "hi"}]}, "conversations[0].value: empty user turn (null)"),
    ({"conversations": [{"from": "human", "value": ""}]}, "conversations[0].value: empty user turn (an empty string)"),
    ({"system": "be brief", "conversations": [{"from": "human", "value": " \n "}]}, "conversations[0].value: empty user turn (only whitespace)"),
    # a later user turn counts as much as the first: it is a prompt once the history is replayed
    ({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}, {"from": "human", "value": None}]},
     "conversations[2].value: empty user turn (null)"),
]  # fmt: skip
MESSAGES = [
    ({"messages": [_user("what is 2+2?")]}, None),
    ({"messages": [_user(None)]}, "messages[0].content: empty user turn (null)"),
    ({"messages": [{"role": "system", "content": "s"}, _user("")]}, "messages[1].content: empty user turn (an empty string)"),
    ({"messages": [_user([])]}, "messages[0].content: empty user turn (no text in its parts)"),
    ({"messages": [_user([{"type": "text", "text": ""}])]}, "messages[0].content: empty user turn (no text in its parts)"),
    ({"messages": [{"role": "user"}]}, "messages[0].content: missing"),
    ({"messages": [_user(7)]}, "messages[0].content: expected a string or a list of content parts, got int"),
    ({"messages": [_user({"text": "hi"})]}, "messages[0].content: expected a string or a list of content parts, got dict"),
    # an assistant turn that only calls a tool keeps its null content: that is not a prompt
    ({"messages": [_user("call it"), {"role": "assistant", "content": None,
                                      "tool_calls": [{"name": "f", "arguments": {}}]}]}, None),
]  # fmt: skip
INSTRUCTION = [
    ({"instruction": "say hi", "output": "hi"}, None),
    ({"instruction": None, "output": "x"}, "instruction: expected a string, got null"),
    ({"instruction": "", "input": "  "}, "instruction: empty instruction and input"),
]
PROMPT_RESPONSE = [
    ({"prompt": "tell me", "response": "ok"}, None),
    ({"prompt": None, "response": "x"}, "prompt: expected a string, got null"),
    ({"prompt": "   ", "response": "x"}, "prompt: empty prompt"),
]


def test_empty_user_turns_are_quarantined_in_every_format(tmp_path):
    """Before: `{"role": "user", "content": null}` (and its ShareGPT twin) became a user turn with ""
    and reached the prompt shards. Now each is a quarantine record that names the field."""
    # the messages rows also arrive through Parquet, where null content is a real Arrow null
    pq.write_table(pa.Table.from_pylist([{"messages": [_user(None)]}, {"messages": [_user("fine")]}]),
                   tmp_path / "msgs.parquet")  # fmt: skip
    sources = [
        {"name": "sg", "path": _jsonl(tmp_path / "sg.jsonl", [r for r, _ in SHAREGPT]), "format": "sharegpt"},
        {"name": "msg", "path": _jsonl(tmp_path / "msg.jsonl", [r for r, _ in MESSAGES]), "format": "messages"},
        {"name": "pq", "path": "msgs.parquet", "format": "messages"},
        {"name": "ins", "path": _jsonl(tmp_path / "ins.jsonl", [r for r, _ in INSTRUCTION]), "format": "instruction"},
        {"name": "pr", "path": _jsonl(tmp_path / "pr.jsonl", [r for r, _ in PROMPT_RESPONSE]),
         "format": "prompt_response"},
        {"name": "tok", "path": _jsonl(tmp_path / "tok.jsonl", [{"input_ids": [1, 2], "loss_mask": [0, 1]}]),
         "format": "pretokenized"},
    ]  # fmt: skip
    mix_path = tmp_path / "mix.yaml"
    mix_path.write_text(yaml.safe_dump({"name": "empty-user", "target": {"model": "m"}, "shard_size": 4,
                                        "sources": sources}))  # fmt: skip
    mix = load_mix(mix_path)
    storage = Storage(str(tmp_path / "data"))
    run_id = run_id_for(mix)
    manifest = prepare_run(mix, storage, run_id, mix_path.read_text())
    layout = RunLayout(storage, run_id)

    got = {(q["source"], q["row_index"]): q for q in pq.read_table(layout.quarantine_path).to_pylist()}
    expected = {("pq", 0): "messages[0].content: empty user turn (null)"}
    for name, rows in (("sg", SHAREGPT), ("msg", MESSAGES), ("ins", INSTRUCTION), ("pr", PROMPT_RESPONSE)):
        expected |= {(name, i): why for i, (_, why) in enumerate(rows) if why}
    assert set(got) == set(expected), sorted(got)
    for key, why in expected.items():
        assert got[key]["reason"].startswith(why), (key, got[key]["reason"])
        assert "\n" not in got[key]["reason"] and got[key]["raw"]
    assert "fill in the turn's text or remove the row" in got[("msg", 1)]["reason"]
    assert {n: s.quarantined for n, s in manifest.sources.items()} == {
        "sg": 4, "msg": 7, "pq": 1, "ins": 2, "pr": 2, "tok": 0,
    }  # fmt: skip

    records = [
        r
        for s in manifest.shards
        for r in prompts_from_table(storage.read_table(layout.prompt_shard(s.shard_id)))
    ]
    assert len(records) == manifest.num_prompts == 1 + 2 + 1 + 1 + 1 + 1
    for r in records:
        if r.conversation is not None:
            users = [m.content for m in r.conversation.messages if m.role == "user"]
            assert users and all(u.strip() for u in users), r


def test_demo_summary_counts_pretokenized_rows_as_passthrough(settings, settings_env, tmp_path):
    """Before: `regen demo` printed every error-free row as answered, the pretokenized ones (never sent
    to an engine) included. Now they are their own column, and answered counts engine answers only."""
    from tests.procs import regen_cmd

    prompts = [{"prompt": f"question number {i}?", "response": "old"} for i in range(5)]
    data = yaml.safe_load((DEMO / "mix.yaml").read_text())
    data["name"] = "demo-passthrough"
    data["target"]["tokenizer"] = str(DEMO / "tokenizer")
    data["sources"] = [
        {"name": "asked", "path": _jsonl(tmp_path / "asked.jsonl", prompts), "format": "prompt_response"},
        {"name": "pretok", "path": str(DEMO / "data" / "pretokenized.jsonl"), "format": "pretokenized"},
    ]
    mix = tmp_path / "mix.yaml"
    mix.write_text(yaml.safe_dump(data))
    res = subprocess.run(regen_cmd("demo", "--mix", str(mix), "--timeout-s", "600"), capture_output=True,
                         text=True, env={**os.environ, **settings_env}, timeout=900)  # fmt: skip
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    lines = res.stdout.splitlines()
    header = next(line.split() for line in lines if line.split()[:1] == ["source"])
    assert header == [
        "source",
        "read",
        "kept",
        "dup",
        "quar",
        "answered",
        "passthrough",
        "reused",
        "errors",
        "tokens",
    ]
    rows = {cells[0]: dict(zip(header[1:], map(int, cells[1:]), strict=True))
            for line in lines if (cells := line.split()) and cells[0] in ("asked", "pretok")}  # fmt: skip
    assert rows["asked"]["kept"] == 5 and rows["asked"]["answered"] == 5 and rows["asked"]["passthrough"] == 0
    assert rows["asked"]["tokens"] > 0
    pretok = rows["pretok"]
    assert pretok["kept"] > 0 and pretok["passthrough"] == pretok["kept"]
    assert pretok["answered"] == 0 and pretok["errors"] == 0 and pretok["tokens"] == 0
    assert re.search(r"demo finished in [\d.]+s", res.stdout)
