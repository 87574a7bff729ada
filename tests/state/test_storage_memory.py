"""Storage on a store that is not the local disk: fsspec's memory:// in place of s3:// or gs://.

The README advertises object-store data roots; these run Storage's writes (no atomic rename there:
a temporary object then a move), its reads, listing and removal, and a whole output shard written
through Storage and read back with plain pyarrow the way another process (the trainer, a notebook)
would read it.
"""

from __future__ import annotations

import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from regen_service.errors import ConfigError
from regen_service.state.storage import RunLayout, Storage
from schemas.conversation import Message, ToolCall
from schemas.rows import OutputRow, Turn, output_rows, output_table
from schemas.tables import OUTPUT_SCHEMA, SCHEMA_VERSION, SCHEMA_VERSION_KEY


@pytest.fixture
def storage():
    s = Storage(f"memory://regen-{uuid.uuid4().hex}/data")
    yield s
    s.remove(s.root, recursive=True)


def _no_temporaries(storage: Storage) -> list[str]:
    return [p for p in storage.fs.find(storage.root) if "/.tmp-" in p]


def test_memory_store_is_not_local_and_paths_stay_under_the_root(storage):
    assert not storage.is_local
    assert storage.path("runs", "r") == f"{storage.root}/runs/r"
    for bad in ("..", ".", "a/b", ""):
        with pytest.raises(ConfigError):
            storage.path("runs", bad)


def test_bytes_and_json_are_written_whole_and_replaced(storage):
    path = storage.path("runs", "r", "manifest.json")
    assert not storage.exists(path) and storage.ls(storage.path("runs")) == []
    storage.write_json_atomic(path, {"a": 1})
    storage.write_json_atomic(path, {"a": 2, "b": [1, 2]})  # overwrite: the move replaces the object
    assert storage.read_json(path) == {"a": 2, "b": [1, 2]}
    storage.write_bytes_atomic(storage.path("runs", "r", "mix.yaml"), "name: ü\n".encode())
    assert storage.read_bytes(storage.path("runs", "r", "mix.yaml")).decode() == "name: ü\n"
    assert [p.rsplit("/", 1)[1] for p in storage.ls(storage.path("runs", "r"))] == [
        "manifest.json",
        "mix.yaml",
    ]
    assert _no_temporaries(storage) == []
    storage.remove(storage.path("runs", "r"), recursive=True)
    assert not storage.exists(path) and storage.ls(storage.path("runs", "r")) == []
    storage.remove(storage.path("runs", "gone"), recursive=True)  # removing what is not there is fine


def test_tables_carry_the_schema_version_and_a_foreign_one_is_refused(storage):
    path = storage.path("t.parquet")
    storage.write_table_atomic(path, pa.table({"a": [1, 2]}))
    table = storage.read_table(path)
    assert table.column("a").to_pylist() == [1, 2]
    assert table.schema.metadata[SCHEMA_VERSION_KEY] == SCHEMA_VERSION.encode()
    old = pa.table({"a": [1]}).replace_schema_metadata({SCHEMA_VERSION_KEY: b"0"})
    with storage.fs.open(storage.path("old.parquet"), "wb") as f:
        pq.write_table(old, f)
    with pytest.raises(ValueError, match="schema version 0"):
        storage.read_table(storage.path("old.parquet"))


def test_an_output_shard_round_trips_through_the_store_and_reads_with_pyarrow(storage):
    layout = RunLayout(storage, "mix-0123456789ab")
    call = ToolCall(id="functions.lookup:0", name="lookup", arguments='{"q": "x"}')
    rows = [
        OutputRow(
            run_id=layout.run_id,
            prompt_id=f"p{i}",
            source="s",
            row_index=i,
            messages=(
                Message(role="system", content="be brief"),
                Message(role="user", content=f"q{i}"),
                Message(role="assistant", content="a", reasoning_content="r", tool_calls=(call,)),
                Message(role="tool", content="42", name="lookup", tool_call_id=call.id),
            ),
            tools='[{"function": {"name": "lookup"}, "type": "function"}]',
            turns=[Turn(message_index=2, text="r</think>a", finish_reason="tool_calls", attempts=1)],
            finish_reason="tool_calls",
            completion_tokens=3,
            latency_s=0.5,
            attempts=1,
        )
        for i in range(3)
    ]
    rows.append(OutputRow(run_id=layout.run_id, prompt_id="px", source="t", row_index=9, input_ids=[1, 2],
                          loss_mask=[0, 1], turns=[], attempts=0))  # fmt: skip
    path = layout.output_shard(0)
    storage.write_table_atomic(path, output_table(rows))
    assert RunLayout.list_runs(storage) == [layout.run_id]
    assert storage.ls(layout.outputs_dir) == [path] and _no_temporaries(storage) == []

    with storage.fs.open(path, "rb") as f:  # another process, with nothing but pyarrow and fsspec
        table = pq.read_table(f)
    # Parquet names list items "element" where pyarrow says "item": same columns, same types otherwise
    assert table.schema.metadata == OUTPUT_SCHEMA.metadata
    assert table.cast(OUTPUT_SCHEMA).equals(output_table(rows))
    assert output_rows(table) == rows
    assert table.to_pylist() == [r.to_record() for r in rows]
    assert output_rows(storage.read_table(path).select(["prompt_id", "error"]))[3] == OutputRow(
        prompt_id="px"
    )


def test_a_run_prepares_onto_the_store_and_its_prompts_read_back(storage, tmp_path):
    from regen_service.produce.prepare import prepare_run
    from schemas.mix import parse_mix
    from schemas.prompt_rows import prompts_from_table

    (tmp_path / "chat.jsonl").write_text(
        '{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}\n'
        '{"messages": [{"role": "user", "content": "yo"}]}\n'
        "not json\n"
    )
    spec = {
        "name": "mem",
        "target": {"model": "m"},
        "sources": [{"name": "c", "path": "chat.jsonl", "format": "messages"}],
    }
    manifest = prepare_run(parse_mix(spec, base_dir=str(tmp_path)), storage, "mem-run", "name: mem\n")
    layout = RunLayout(storage, "mem-run")
    assert (
        storage.exists(layout.manifest_path) and storage.read_json(layout.manifest_path)["num_prompts"] == 2
    )
    records = prompts_from_table(storage.read_table(layout.prompt_shard(0)))
    assert sorted(m.content for r in records for m in r.conversation.messages) == ["hi", "s", "yo"]
    assert storage.read_table(layout.quarantine_path).num_rows == manifest.sources["c"].quarantined == 1
    assert _no_temporaries(storage) == []
