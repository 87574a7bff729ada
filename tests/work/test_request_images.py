"""Request images (work/images.py) on a real local image store: chat parts and `image_data` in prompt
order, one read per image, the per-request byte bound checked before any read, and missing or altered
store files refused with their reasons. Output rows keep the images (schemas.rows) and the enqueue
table shows image counts (produce/data_report.py)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io

import pyarrow.parquet as pq
import pytest
from PIL import Image

from regen_service.errors import ImageUnavailableError, RequestImagesTooLargeError, RowTerminalError
from regen_service.produce.data_report import format_report
from regen_service.state.storage import RunLayout, Storage
from regen_service.work.client.engines import vllm_completions_body
from regen_service.work.images import RunImages, chat_messages, image_data
from schemas.conversation import Message
from schemas.media import ImageRef
from schemas.rows import OutputRow, output_rows, output_table
from schemas.tables import OUTPUT_SCHEMA, SCHEMA_VERSION_KEY


def png(colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), colour).save(buf, "PNG")
    return buf.getvalue()


def ref(data: bytes, offset: int) -> ImageRef:
    return ImageRef(offset=offset, sha256=hashlib.sha256(data).hexdigest(), media_type="image/png",
                    width=4, height=4, num_bytes=len(data))  # fmt: skip


@pytest.fixture
def store(tmp_path):
    layout = RunLayout(Storage(str(tmp_path)), "vl-0123456789ab")
    a, b = png((255, 0, 0)), png((0, 0, 255))
    for data in (a, b):
        layout.storage.write_bytes_atomic(layout.image_path(ref(data, 0).file_name), data)
    return layout, a, b


def history(a: bytes, b: bytes) -> list[Message]:
    # b stands after "two: " and a at the start, listed out of order: order comes from the offsets
    return [
        Message(role="user", content="one two: end", images=(ref(b, 9), ref(a, 0))),
        Message(role="assistant", content="ok"),
        Message(role="user", content="again", images=(ref(a, 5),)),
    ]


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_chat_parts_and_image_data_follow_the_text_order(store):
    layout, a, b = store
    msgs = history(a, b)
    urls = asyncio.run(RunImages(layout, 10_000).load(msgs))
    assert len(urls) == 2  # a appears twice and is read once
    chat = chat_messages(msgs, urls)
    assert chat[0]["content"] == [
        {"type": "image_url", "image_url": {"url": data_url(a)}},
        {"type": "text", "text": "one two: "},
        {"type": "image_url", "image_url": {"url": data_url(b)}},
        {"type": "text", "text": "end"},
    ]
    assert chat[1] == {"role": "assistant", "content": "ok"}
    assert chat[2]["content"][-1] == {"type": "image_url", "image_url": {"url": data_url(a)}}
    assert image_data(msgs, urls) == [data_url(a), data_url(b), data_url(a)]


def test_the_request_bound_counts_every_part_and_reads_nothing(store, tmp_path):
    layout, a, b = store
    msgs = history(a, b)
    total = 2 * len(a) + len(b)
    layout.storage.remove(layout.images_dir, recursive=True)  # a read would fail differently
    with pytest.raises(RequestImagesTooLargeError, match=f"3 image part\\(s\\) of {total} bytes"):
        asyncio.run(RunImages(layout, total - 1).load(msgs))


def test_a_missing_or_altered_image_is_refused_with_its_reason(store):
    layout, a, b = store
    msgs = history(a, b)
    layout.storage.write_bytes_atomic(layout.image_path(ref(b, 0).file_name), png((1, 2, 3)))
    with pytest.raises(ImageUnavailableError, match="no longer hashes to its name"):
        asyncio.run(RunImages(layout, 10_000).load(msgs))
    layout.storage.remove(layout.image_path(ref(a, 0).file_name))
    with pytest.raises(ImageUnavailableError, match="missing from the run's image store"):
        asyncio.run(RunImages(layout, 10_000).load(msgs))


def test_output_rows_carry_image_refs_and_say_version_2(store, tmp_path):
    _, a, b = store
    row = OutputRow(run_id="r", prompt_id="p", messages=tuple(history(a, b)))
    text = OutputRow(run_id="r", prompt_id="q", messages=(Message(role="user", content="hi"),))
    table = output_table([row, text])
    assert table.schema.metadata[SCHEMA_VERSION_KEY] == b"2" and "images" in table.column_names
    assert output_rows(table)[0] == row and output_rows(table)[1] == text
    assert table.column("images").to_pylist()[0][0]["message_index"] == 0
    # a text-only run keeps version 1 and its columns; an image run's text-only shard has the column
    assert output_table([text]).schema == OUTPUT_SCHEMA
    assert "images" in output_table([text], images=True).column_names
    pq.write_table(table, tmp_path / "o.parquet")
    assert output_rows(pq.read_table(tmp_path / "o.parquet"))[0].messages[0].images == row.messages[0].images


def test_enqueue_table_shows_image_counts_only_when_a_source_has_images():
    base = {"read": 3, "kept": 3, "duplicate": 0, "quarantined": 0, "top_reasons": []}
    text = format_report({"chat": base | {"images": 0, "images_stored": 0}})
    assert "images" not in text.splitlines()[0]
    vl = format_report(
        {"chat": base | {"images": 0, "images_stored": 0}, "vl": base | {"images": 5, "images_stored": 2}}
    )
    head, _, vl_line = vl.splitlines()
    assert head.split()[:7] == ["source", "read", "kept", "dup", "quarantined", "images", "stored"]
    assert vl_line.split()[:7] == ["vl", "3", "3", "0", "0", "5", "2"]


def test_api_generate_on_vllm_refuses_images_rather_than_dropping_them():
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}}
    assert vllm_completions_body(body, "m")["prompt"] == [1, 2]
    with pytest.raises(RowTerminalError, match="use api: chat for image mixes on vLLM"):
        vllm_completions_body({**body, "image_data": ["data:image/png;base64,AAAA"]}, "m")
