"""Real public dataset extracts (../shared/samples, read in place, never copied): every quirk handled.

Each file goes through prepare_run alone and all together; the counts asserted are facts of the files
(PROVENANCE.md): glaive holds 35 exact duplicate records and alpaca one; the with-system FastChat file
equals the plain one except for its 6 records with a system prompt.
"""

from __future__ import annotations

import json

import pytest

from regen_service.produce.prepare import prepare_run
from regen_service.produce.sources import normalize_row, read_rows
from regen_service.state.storage import RunLayout, Storage
from schemas.mix import parse_mix
from schemas.prompt_rows import prompts_from_table
from tests.procs import SAMPLES

pytestmark = pytest.mark.skipif(not SAMPLES.is_dir(), reason=f"{SAMPLES} not present")

# name -> (file, format, fields, expected (read, kept, duplicate, quarantined, sampled_out) alone)
FILES = {
    "fastchat": ("sharegpt_fastchat_dummy.jsonl", "sharegpt", {}, (500, 500, 0, 0, 0)),
    "fastchat_sys": ("sharegpt_fastchat_dummy_with_system.jsonl", "sharegpt", {}, (500, 500, 0, 0, 0)),
    "glaive": ("toolcall_llamafactory_glaive_en_demo.jsonl", "sharegpt", {}, (300, 265, 35, 0, 0)),
    "xtuner_text": ("openai_messages_xtuner_mllm_sft_text.jsonl", "messages", {}, (200, 200, 0, 0, 0)),
    # records 15 and 16 differ only in their (dropped) video: the same text prompt, deduplicated
    "xtuner_tools": ("openai_messages_toolcall_xtuner_qwen35.jsonl", "messages", {}, (17, 16, 1, 0, 0)),
    "alpaca": ("alpaca_llamafactory_en_demo.jsonl", "instruction", {}, (500, 499, 1, 0, 0)),
    "selfinstruct": (
        "prompt_completion_selfinstruct_t0_adversarial_qa.jsonl",
        "prompt_response",
        {"response": "completion"},
        (200, 200, 0, 0, 0),
    ),
}


def mix_of(names: list[str], **extra):
    sources = [
        {"name": n, "path": FILES[n][0], "format": FILES[n][1], "fields": FILES[n][2], **extra} for n in names
    ]
    return parse_mix({"name": "samples", "target": {"model": "m"}, "sources": sources}, base_dir=str(SAMPLES))


def records(mix, name: str):
    source = next(s for s in mix.sources if s.name == name)
    return [normalize_row(source, raw, i) for i, raw in read_rows(mix, source)]


@pytest.mark.parametrize("name", list(FILES))
def test_each_file_prepares_alone(name, tmp_path):
    mix = mix_of([name])
    manifest = prepare_run(mix, Storage(str(tmp_path)), "r", "")
    s = manifest.sources[name]
    assert (s.read, s.kept, s.duplicate, s.quarantined, s.sampled_out) == FILES[name][3]
    layout = RunLayout(Storage(str(tmp_path)), "r")
    got = [
        r
        for sh in manifest.shards
        for r in prompts_from_table(layout.storage.read_table(layout.prompt_shard(sh.shard_id)))
    ]
    assert len(got) == s.kept


def test_all_files_together_dedup_across_sources(tmp_path):
    manifest = prepare_run(mix_of(list(FILES)), Storage(str(tmp_path)), "r", "")
    # the 494 records without `system` are the plain file's records again: first occurrence wins
    assert (manifest.sources["fastchat_sys"].kept, manifest.sources["fastchat_sys"].duplicate) == (6, 494)
    assert manifest.num_prompts == 500 + 6 + 265 + 200 + 16 + 499 + 200


def test_top_level_system_key():
    recs = records(mix_of(["fastchat_sys"]), "fastchat_sys")
    with_system = [r for r in recs if r.conversation.messages[0].role == "system"]
    assert len(with_system) == 6 and all(r.conversation.messages[1].role == "user" for r in with_system)


def test_glaive_function_calls_observations_and_string_tools():
    recs = records(mix_of(["glaive"]), "glaive")
    calls = [c for r in recs for m in r.conversation.messages for c in (m.tool_calls or ())]
    assert len(calls) == 211 and all(json.loads(c.arguments) is not None for c in calls)
    assert all(isinstance(c.arguments, str) for c in calls)
    tool_msgs = [m for r in recs for m in r.conversation.messages if m.role == "tool"]
    assert len(tool_msgs) == 211 and all(m.name for m in tool_msgs)  # named after the call they answer
    assert sum(r.conversation.tools is None for r in recs) == 109  # the literal string "[]"
    declared = [t for r in recs for t in (r.conversation.tools or ())]
    assert declared and all(t["type"] == "function" and "name" in t["function"] for t in declared)


def test_xtuner_tool_calls_parts_reasoning_and_newlines():
    recs = records(mix_of(["xtuner_tools"]), "xtuner_tools")
    msgs = [m for r in recs for m in r.conversation.messages]
    calls = [c for m in msgs for c in (m.tool_calls or ())]
    assert len(calls) == 9 and all(
        isinstance(json.loads(c.arguments), dict) for c in calls
    )  # objects -> JSON
    tools = [m for m in msgs if m.role == "tool"]
    # the file's tool messages carry no id: they take the name and id of the call they answer, in order
    ids = {c.id for c in calls}
    assert len(tools) == 9 and all(m.name == "get_weather" and m.tool_call_id in ids for m in tools)
    assert sum(m.reasoning_content is not None for m in msgs) == 18
    assert sum(r.num_dropped_parts for r in recs) == 9  # 3 images and 6 videos
    rec3 = next(r for r in recs if r.row_index == 2)  # record id 3
    assistant = rec3.conversation.messages[-1]
    assert (
        assistant.content.startswith("\n")
        and assistant.reasoning_content == "\n这是 reasoning_content 内容\n"
    )


def test_chinese_text_kept():
    recs = records(mix_of(["xtuner_text"]), "xtuner_text")
    assert (
        sum(any("\u4e00" <= ch <= "\u9fff" for ch in r.conversation.messages[0].content) for r in recs) == 100
    )


def test_completion_end_marker_stripped_and_prompt_verbatim():
    recs = records(mix_of(["selfinstruct"]), "selfinstruct")
    for r in recs:
        user, assistant = r.conversation.messages
        assert user.content.endswith("\n") and "<|endoftext|>" not in assistant.content and assistant.content


def test_alpaca_input_joined():
    recs = records(mix_of(["alpaca"]), "alpaca")
    joined = [r for r in recs if "\n\n" in r.conversation.messages[0].content]
    assert len(recs) == 500 and len(joined) >= 213 - 5  # 213 rows have a non-empty input


def test_max_samples_on_a_real_file(tmp_path):
    manifest = prepare_run(mix_of(["alpaca"], max_samples=50), Storage(str(tmp_path)), "r", "")
    s = manifest.sources["alpaca"]
    assert (s.read, s.kept + s.duplicate, s.sampled_out) == (500, 50, 450)
