"""ShardLog's promises under faults: every row appended before a kill is loaded back, a line torn by
the kill is dropped (that prompt is asked again), a new holder after a crash continues where the
last stopped, and on stores without append only whole Parquet parts count.

Local data roots get one JSON-lines log per holder; memory:// stands in for an object store (no
append), where rows go to Parquet part files written under a temporary name and renamed.
"""

from __future__ import annotations

import json
import uuid

import pytest

from regen_service.state.shard_log import ShardLog
from regen_service.state.storage import RunLayout, Storage
from schemas.conversation import Message, ToolCall
from schemas.rows import OutputRow, Turn


def _row(i: int, **kw) -> OutputRow:
    call = ToolCall(id=f"c{i}", name="lookup", arguments='{"q": "ünïcode"}')
    return OutputRow(
        run_id="r",
        prompt_id=f"p{i}",
        source="s",
        row_index=i,
        messages=(
            Message(role="user", content=f"question {i} — ✓"),
            Message(role="assistant", content="", reasoning_content="thinking", tool_calls=(call,)),
        ),
        turns=[Turn(message_index=1, text="thinking</think>", output_ids=[1, 2], prompt_len=3, attempts=1)],
        input_ids=[5, 6, 1, 2],
        loss_mask=[0, 0, 1, 1],
        completion_tokens=2,
        attempts=1,
        **kw,
    )


@pytest.fixture
def local(tmp_path) -> RunLayout:
    return RunLayout(Storage(str(tmp_path)), "r")


@pytest.fixture
def memory():
    storage = Storage(f"memory://shard-log-{uuid.uuid4().hex}")
    yield RunLayout(storage, "r")
    storage.remove(storage.root, recursive=True)


def _log_file(layout: RunLayout, owner: str) -> str:
    return f"{layout.parts_dir(0)}/{owner}.jsonl"


def test_local_rows_are_durable_at_append_and_load_back_typed(local):
    log = ShardLog(local, 0, "w1")
    rows = [_row(i) for i in range(3)]
    for row in rows:
        log.append(row)
    # not closed: a kill now keeps every appended row (one write per row, no buffer)
    assert ShardLog(local, 0, "reader").load() == {r.prompt_id: r for r in rows}
    log.close()


@pytest.mark.parametrize("cut", [1, 10, -3])
def test_a_torn_last_line_is_dropped_and_the_rest_kept(local, cut):
    log = ShardLog(local, 0, "w1")
    for i in range(2):
        log.append(_row(i))
    log.close()
    line = json.dumps(_row(2).to_record(), ensure_ascii=False).encode()
    with open(_log_file(local, "w1"), "ab") as f:
        f.write(line[:cut])  # the kill came mid-write: no newline, JSON cut short
    assert sorted(ShardLog(local, 0, "reader").load()) == ["p0", "p1"]


def test_a_line_torn_inside_a_multibyte_character_is_dropped(local):
    line = json.dumps(_row(0).to_record(), ensure_ascii=False).encode()
    at = line.index("✓".encode()) + 1  # between the bytes of one UTF-8 character
    local.storage.makedirs(local.parts_dir(0))
    with open(_log_file(local, "w1"), "wb") as f:
        f.write(line[:at])
    assert ShardLog(local, 0, "reader").load() == {}


def test_a_new_holder_after_a_crash_continues_and_the_first_row_wins(local):
    crashed = ShardLog(local, 0, "w1")
    crashed.append(_row(0))
    crashed.append(_row(1))
    with open(_log_file(local, "w1"), "ab") as f:
        f.write(b'{"run_id":"r","prompt_id":"p2"')  # torn: p2 was in flight
    # no close(): the process died. The next holder loads what is durable and asks the rest.
    again = ShardLog(local, 0, "w2")
    done = again.load()
    assert sorted(done) == ["p0", "p1"]
    again.append(_row(2))
    again.append(_row(1, error="late duplicate"))  # a row asked twice: the first durable one wins
    again.close()
    loaded = ShardLog(local, 0, "reader").load()
    assert sorted(loaded) == ["p0", "p1", "p2"] and loaded["p1"].error is None
    again.remove()
    assert not local.storage.exists(local.parts_dir(0)) and ShardLog(local, 0, "r").load() == {}


def test_stray_files_in_the_parts_folder_are_ignored(local):
    log = ShardLog(local, 0, "w1")
    log.append(_row(0))
    log.close()
    local.storage.write_bytes_atomic(f"{local.parts_dir(0)}/notes.txt", b"not a log")
    local.storage.write_bytes_atomic(f"{local.parts_dir(0)}/.tmp-abc-part-x.parquet", b"PAR1 half")
    assert list(ShardLog(local, 0, "reader").load()) == ["p0"]


def test_object_store_rows_are_buffered_then_flushed_as_parquet_parts(memory):
    log = ShardLog(memory, 0, "w1", flush_rows=2, flush_interval_s=3600)
    log.append(_row(0))
    assert ShardLog(memory, 0, "reader").load() == {}  # buffered, not yet durable
    log.append(_row(1))  # flush_rows reached: one part
    parts = memory.storage.ls(memory.parts_dir(0))
    assert len(parts) == 1 and parts[0].endswith(".parquet") and "/part-w1-" in parts[0]
    log.append(_row(2))
    log.close()  # the rest flushed
    loaded = ShardLog(memory, 0, "reader").load()
    assert loaded == {f"p{i}": _row(i) for i in range(3)}
    log.remove()
    assert ShardLog(memory, 0, "reader").load() == {}


def test_object_store_a_part_cut_short_by_a_crash_is_never_read(memory):
    log = ShardLog(memory, 0, "w1", flush_rows=1)
    log.append(_row(0))
    whole = memory.storage.read_bytes(memory.storage.ls(memory.parts_dir(0))[0])
    # A crash during the next upload leaves only its temporary object, cut short.
    fs = memory.storage.fs
    with fs.open(f"{memory.parts_dir(0)}/.tmp-{uuid.uuid4().hex}-part-w1-dead.parquet", "wb") as f:
        f.write(whole[: len(whole) // 2])
    assert list(ShardLog(memory, 0, "w2").load()) == ["p0"]


def test_object_store_flushes_after_the_interval(memory, monkeypatch):
    import regen_service.state.shard_log as shard_log

    now = [1000.0]
    monkeypatch.setattr(shard_log.time, "monotonic", lambda: now[0])
    log = ShardLog(memory, 0, "w1", flush_rows=100, flush_interval_s=1.0)
    log.append(_row(0))
    assert ShardLog(memory, 0, "reader").load() == {}
    now[0] += 1.5
    log.append(_row(1))  # the interval passed: both rows flushed
    assert sorted(ShardLog(memory, 0, "reader").load()) == ["p0", "p1"]
