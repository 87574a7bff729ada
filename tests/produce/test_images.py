"""Sources with images: every way a row names an image, the run's image store, and each bad image quarantined.

Images are made here with Pillow; runs go through the real producer (`enqueue` with Redis, or `prepare_run`)
and are read back with pyarrow and `datasets`.
"""

from __future__ import annotations

import base64
import http.server
import io
import json
import random
import threading
from pathlib import Path
from typing import ClassVar

import datasets
import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from regen_service.errors import ConfigError
from regen_service.produce.prepare import prepare_run, run_id_for
from regen_service.produce.producer import enqueue
from regen_service.state.storage import RunLayout, Storage
from schemas.mix import load_mix
from schemas.prompt_rows import prompts_from_table
from schemas.tables import PROMPT_SCHEMA, SCHEMA_VERSION_KEY


def image_bytes(fmt: str = "PNG", size=(8, 6), color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format=fmt)
    return buf.getvalue()


def noise_png(size=(64, 64), seed: int = 0) -> bytes:
    """A PNG that does not compress: what a photo costs, unlike a flat square of 155 bytes."""
    buf = io.BytesIO()
    Image.frombytes("RGB", size, random.Random(seed).randbytes(size[0] * size[1] * 3)).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def write_mix(folder: Path, sources: list[dict], images: dict | None = None) -> Path:
    data = {"name": "img", "target": {"model": "m"}, "shard_size": 64, "sources": sources}
    if images is not None:
        data["images"] = images
    path = folder / "mix.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path.name


def prepare(mix_path: Path, root: Path):
    mix = load_mix(mix_path)
    storage = Storage(str(root))
    run_id = run_id_for(mix)
    return prepare_run(mix, storage, run_id, mix_path.read_text()), RunLayout(storage, run_id)


def records(layout: RunLayout, manifest) -> list:
    return [
        r
        for s in manifest.shards
        for r in prompts_from_table(layout.storage.read_table(layout.prompt_shard(s.shard_id)))
    ]


def quarantine(layout: RunLayout) -> list[dict]:
    return layout.storage.read_table(layout.quarantine_path).to_pylist()


def test_openai_image_parts_from_a_data_url_and_a_path_through_enqueue(tmp_path, settings):
    png, jpg = image_bytes("PNG"), image_bytes("JPEG", (16, 12), (10, 200, 10))
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "cat.jpg").write_bytes(jpg)
    rows = [
        {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "Compare "},
            {"type": "image_url", "image_url": {"url": data_url(png)}},
            {"type": "text", "text": " with "},
            {"type": "image_url", "image_url": {"url": "pics/cat.jpg"}},
        ]}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "pics/cat.jpg"}}]}]},
        {"messages": [{"role": "user", "content": "text only"}]},
    ]  # fmt: skip
    mix = write_mix(
        tmp_path, [{"name": "oa", "path": jsonl(tmp_path / "oa.jsonl", rows), "format": "messages"}], {}
    )
    res = enqueue(settings, mix)
    layout = RunLayout(Storage(settings.data_root), res.run_id)
    manifest = json.loads(layout.storage.read_bytes(layout.manifest_path))
    st = manifest["sources"]["oa"]
    assert (st["kept"], st["quarantined"], st["images"], st["images_stored"]) == (3, 0, 3, 2)
    stored = sorted(Path(layout.images_dir).iterdir())
    assert sorted(p.read_bytes() for p in stored) == sorted([png, jpg])
    assert {p.suffix for p in stored} == {".png", ".jpg"}

    shard = layout.prompt_shard(0)
    table = pq.read_table(shard)
    assert table.schema.metadata[SCHEMA_VERSION_KEY] == b"2" and "images" in table.column_names
    ds = datasets.load_dataset("parquet", data_files=shard, split="train")
    by_text = {r["messages"][0]["content"]: r for r in ds}
    parts = by_text["Compare  with "]["images"]
    assert [(p["offset"], p["media_type"], p["width"], p["height"]) for p in parts] == [
        (8, "image/png", 8, 6),
        (14, "image/jpeg", 16, 12),
    ]
    assert by_text["text only"]["images"] is None
    rec = next(r for r in prompts_from_table(table) if r.conversation.messages[0].content == "Compare  with ")
    assert (Path(layout.images_dir) / rec.conversation.messages[0].images[0].file_name).read_bytes() == png
    content = rec.conversation.messages[0].to_dict("template")["content"]
    assert [p["type"] for p in content] == ["text", "image_url", "text", "image_url"]
    assert content[0]["text"] == "Compare " and content[2]["text"] == " with "
    assert content[3]["image_url"]["url"] == f"images/{rec.conversation.messages[0].images[1].file_name}"


def test_sharegpt4v_placeholders_and_image_fields(tmp_path):
    (tmp_path / "coco").mkdir()
    a, b = image_bytes(color=(1, 2, 3)), image_bytes(color=(4, 5, 6))
    (tmp_path / "coco" / "a.png").write_bytes(a)
    (tmp_path / "coco" / "b.png").write_bytes(b)
    rows = [
        {"image": "coco/a.png", "conversations": [{"from": "human", "value": "<image>\nWhat is this?"},
                                                  {"from": "gpt", "value": "A square."}]},
        {"images": ["coco/a.png", "coco/b.png"],
         "conversations": [{"from": "human", "value": "First <image> then <image>."}]},
    ]  # fmt: skip
    src = {"name": "s4v", "path": jsonl(tmp_path / "s.jsonl", rows), "format": "sharegpt"}
    manifest, layout = prepare(write_mix(tmp_path, [src], {}), tmp_path / "data")
    assert manifest.sources["s4v"].images == 3 and manifest.sources["s4v"].images_stored == 2
    recs = {r.row_index: r for r in records(layout, manifest)}
    m0 = recs[0].conversation.messages[0]
    assert m0.content == "\nWhat is this?" and [i.offset for i in m0.images] == [0]
    m1 = recs[1].conversation.messages[0]
    assert m1.content == "First  then ." and [i.offset for i in m1.images] == [6, 12]
    assert len({i.sha256 for i in m1.images}) == 2
    assert recs[0].conversation.messages[1].images is None  # the answer holds no image


def test_hugging_face_image_column(tmp_path):
    imgs = [image_bytes(color=(i, i, i)) for i in (10, 20)]
    ds = datasets.Dataset.from_dict(
        {
            "images": [[{"bytes": imgs[0], "path": None}], [{"bytes": imgs[1], "path": None}]],
            "messages": [
                [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Describe {i}."}]}]
                for i in range(2)
            ],
        },
        features=datasets.Features(
            {
                "images": datasets.List(datasets.Image()),
                "messages": datasets.List(
                    {
                        "role": datasets.Value("string"),
                        "content": datasets.List(
                            {"type": datasets.Value("string"), "text": datasets.Value("string")}
                        ),
                    }
                ),
            }
        ),
    )
    ds.to_parquet(str(tmp_path / "vl.parquet"))
    src = {"name": "hfvl", "hf": {"path": "parquet", "data_files": "vl.parquet"}, "format": "messages"}
    manifest, layout = prepare(write_mix(tmp_path, [src], {}), tmp_path / "data")
    assert manifest.sources["hfvl"].kept == 2 and manifest.sources["hfvl"].images_stored == 2, quarantine(
        layout
    )
    names = {p.name: p.read_bytes() for p in Path(layout.images_dir).iterdir()}
    assert sorted(names.values()) == sorted(imgs)
    # a broken image in the column: quarantined, its bytes shown by size in `raw`
    bad = ds.cast_column("images", datasets.List(datasets.Image(decode=False)))
    bad = datasets.Dataset.from_list(
        [
            {
                "images": [{"bytes": b"\x89PNG\r\n\x1a\n" + b"x" * 5000, "path": None}],
                "messages": ds[0]["messages"],
            }
        ],
        features=bad.features,
    )
    bad.to_parquet(str(tmp_path / "bad.parquet"))
    src = {"name": "hfbad", "hf": {"path": "parquet", "data_files": "bad.parquet"}, "format": "messages"}
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bad.parquet").write_bytes((tmp_path / "bad.parquet").read_bytes())
    (tmp_path / "b" / "ok.jsonl").write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
    )
    ok = {"name": "ok", "path": "ok.jsonl", "format": "messages"}
    _, bad_layout = prepare(write_mix(tmp_path / "b", [src, ok], {}), tmp_path / "data2")
    (q,) = quarantine(bad_layout)
    assert q["reason"].startswith("images[0]: unreadable image") and "<5008 bytes>" in q["raw"], q
    for r in records(layout, manifest):
        (ref,) = r.conversation.messages[0].images
        assert ref.offset == 0 and names[ref.file_name] == imgs[r.row_index]


def test_one_image_in_many_rows_is_stored_once(tmp_path):
    png = noise_png()
    url = data_url(png)
    n = 50
    rows = [
        {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": f"question {i}"}]}]}
        for i in range(n)
    ]  # fmt: skip
    src = {"name": "many", "path": jsonl(tmp_path / "m.jsonl", rows), "format": "messages"}
    manifest, layout = prepare(write_mix(tmp_path, [src], {}), tmp_path / "data")
    assert manifest.sources["many"].kept == n and manifest.sources["many"].images == n
    stored = list(Path(layout.images_dir).iterdir())
    assert len(stored) == 1 and stored[0].read_bytes() == png
    inline = n * len(png)
    on_disk = stored[0].stat().st_size
    shards = sum(Path(layout.prompt_shard(s.shard_id)).stat().st_size for s in manifest.shards)
    print(
        f"{n} rows, one image: inline {inline} bytes, on disk {on_disk} bytes + prompt shards {shards} bytes"
    )
    assert on_disk * n == inline and on_disk + shards < inline / 10


def _svg() -> bytes:
    return b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg"><script>alert(1)</script></svg>'


@pytest.mark.parametrize(
    ("image", "bounds", "reason"),
    [
        (data_url(image_bytes()[:40]), {}, "unreadable image (Pillow cannot identify it"),
        (data_url(noise_png()[:6000]), {}, "unreadable image (OSError: image file is truncated"),
        (data_url(noise_png()), {"max_image_bytes": 2000}, "image too large ("),
        ("big.png", {"max_image_bytes": 200}, "bytes > max_image_bytes 200"),
        (data_url(image_bytes(size=(40, 40))), {"max_image_pixels": 1000}, "40 x 40 = 1600 pixels > max_image_pixels 1000"),
        (data_url(_svg(), "svg+xml"), {}, "an SVG"),
        (data_url(b"%PDF-1.4 hello"), {}, "not a PNG, JPEG, GIF or WEBP image: a PDF"),
        (data_url(b"\x00\x01\x02\x03 random"), {}, "unknown content"),
        ("https://example.com/cat.png", {}, "points off the machine; refused"),
        ("http://127.0.0.1:9/cat.png", {"allow_remote": True, "remote_timeout_s": 2}, "could not be fetched (ConnectError)"),
        ("ftp://host/cat.png", {}, "scheme"),
        ("missing.png", {}, "cannot be read (No such file"),
        ("data:image/png;base64,@@@", {}, "not valid base64"),
    ],
)  # fmt: skip
def test_bad_images_are_quarantined_with_their_reason(tmp_path, image, bounds, reason):
    (tmp_path / "big.png").write_bytes(image_bytes(size=(300, 300)))
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                   {"type": "text", "text": "what?"}]}]},
        {"messages": [{"role": "user", "content": "a good row"}]},
    ]  # fmt: skip
    src = {"name": "bad", "path": jsonl(tmp_path / "b.jsonl", rows), "format": "messages"}
    manifest, layout = prepare(write_mix(tmp_path, [src], bounds), tmp_path / "data")
    (q,) = quarantine(layout)
    assert q["row_index"] == 0 and reason in q["reason"], q["reason"]
    assert q["reason"].startswith("messages[0].content[0].image_url")
    assert manifest.sources["bad"].quarantined == 1 and manifest.sources["bad"].kept == 1
    assert not Path(layout.images_dir).exists()  # nothing stored for a quarantined row


def test_placeholders_and_images_must_match(tmp_path):
    (tmp_path / "a.png").write_bytes(image_bytes())
    rows = [
        {"image": "a.png", "conversations": [{"from": "human", "value": "no placeholder"}]},
        {"image": "a.png", "conversations": [{"from": "human", "value": "<image> and <image>"}]},
    ]
    src = {"name": "mm", "path": jsonl(tmp_path / "s.jsonl", rows), "format": "sharegpt"}
    mix = write_mix(tmp_path, [src, {"name": "ok", "path": jsonl(tmp_path / "ok.jsonl", [{"conversations": [{"from": "human", "value": "hi"}]}]), "format": "sharegpt"}], {})  # fmt: skip
    _, layout = prepare(mix, tmp_path / "data")
    reasons = [q["reason"] for q in quarantine(layout)]
    assert reasons[0].startswith("image: 1 images given but 0 placed")
    assert "an image placeholder with no image left in `image` (1 given)" in reasons[1]


def test_text_only_mix_writes_the_shard_it_wrote_before_images(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(5)]
    src = {"name": "t", "path": jsonl(tmp_path / "t.jsonl", rows), "format": "messages"}
    plain, with_images = tmp_path / "a", tmp_path / "b"
    plain.mkdir(), with_images.mkdir()
    (plain / "t.jsonl").write_bytes((tmp_path / "t.jsonl").read_bytes())
    (with_images / "t.jsonl").write_bytes((tmp_path / "t.jsonl").read_bytes())
    _, l1 = prepare(write_mix(plain, [src]), tmp_path / "d1")
    _, l2 = prepare(write_mix(with_images, [src], {}), tmp_path / "d2")
    table = pq.read_table(l1.prompt_shard(0))
    assert table.schema == PROMPT_SCHEMA and table.schema.metadata[SCHEMA_VERSION_KEY] == b"1"
    # an `images:` section changes no text-only byte, only the run id (the mix differs)
    assert Path(l1.prompt_shard(0)).read_bytes() == Path(l2.prompt_shard(0)).read_bytes()
    assert "images" not in load_mix(plain / "mix.yaml").identity_dict()


def test_without_an_images_section_image_parts_are_dropped_and_counted(tmp_path):
    rows = [{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                                                       {"type": "text", "text": "q"}]}]}]  # fmt: skip
    src = {"name": "old", "path": jsonl(tmp_path / "o.jsonl", rows), "format": "messages"}
    manifest, layout = prepare(write_mix(tmp_path, [src]), tmp_path / "data")
    (rec,) = records(layout, manifest)
    assert rec.num_dropped_parts == 1 and rec.conversation.messages[0].images is None
    assert manifest.sources["old"].dropped_parts == 1 and manifest.sources["old"].images == 0


def test_unknown_images_setting_names_the_field(tmp_path):
    from schemas.mix import MixError

    src = {"name": "x", "path": jsonl(tmp_path / "x.jsonl", [{"messages": []}]), "format": "messages"}
    with pytest.raises(MixError, match=r"images\.max_image_megabytes: unknown field"):
        load_mix(write_mix(tmp_path, [src], {"max_image_megabytes": 3}))


def _bomb(width: int, height: int) -> bytes:
    """A 67-byte PNG whose header claims width x height: decoding it would inflate to gigabytes."""
    import struct
    import zlib

    data = bytearray(image_bytes(size=(1, 1)))
    ihdr = struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return bytes(data)


@pytest.mark.parametrize(
    ("size", "reason"),
    [
        ((8000, 8000), "8000 x 8000 = 64000000 pixels > max_image_pixels 40000000"),
        ((30000, 30000), "could be decompression bomb"),  # Pillow refuses it at open: still a reason
    ],
)
def test_a_decompression_bomb_is_refused_from_its_header_at_the_default_bound(size, reason):
    from regen_service.produce.sources.base import RowError
    from regen_service.produce.sources.images import ImageReader
    from schemas.media import ImagesSpec

    with pytest.raises(RowError, match="image too large") as err:
        ImageReader(ImagesSpec(), None).check(_bomb(*size), "img")
    assert reason in err.value.reason


@pytest.mark.parametrize(
    ("fmt", "kind"), [("GIF", "image/gif"), ("WEBP", "image/webp"), ("JPEG", "image/jpeg")]
)
def test_gif_webp_and_jpeg_are_accepted(fmt, kind):
    from regen_service.produce.sources.images import ImageReader
    from schemas.media import ImagesSpec

    loaded = ImageReader(ImagesSpec(), None).check(image_bytes(fmt, (5, 3)), "img")
    assert (loaded.ref.media_type, loaded.ref.width, loaded.ref.height) == (kind, 5, 3)
    assert loaded.ref.file_name.endswith({"GIF": ".gif", "WEBP": ".webp", "JPEG": ".jpg"}[fmt])


class _ImageServer(http.server.BaseHTTPRequestHandler):
    """Answers by path: a PNG, a 404, a body larger than it declares, a huge declared length, redirects, an SVG."""

    requests: ClassVar[list[str]] = []

    def do_GET(self):
        _ImageServer.requests.append(self.path)
        png = image_bytes(size=(12, 10))
        if self.path == "/cat.png":
            self._send(200, png)
        elif self.path == "/svg.png":
            self._send(200, _svg())
        elif self.path == "/huge.png":  # declares 10 GB; must be refused before the body is read
            self.send_response(200)
            self.send_header("Content-Length", str(10**10))
            self.end_headers()
        elif self.path == "/endless.png":  # no length, more bytes than the bound
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            for _ in range(64):
                self.wfile.write(b"\x89PNG" + b"\0" * 4096)
        elif self.path == "/hop.png":
            self._redirect("/cat.png")
        elif self.path == "/to-file.png":
            self._redirect("file:///etc/passwd")
        elif self.path == "/loop.png":
            self._redirect("/loop.png")
        else:
            self._send(404, b"no such image")

    def _send(self, status, body):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, where):
        self.send_response(302)
        self.send_header("Location", where)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def image_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageServer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_remote_images_are_fetched_only_when_the_mix_allows_them(tmp_path, image_server):
    names = ["cat", "hop", "404", "huge", "endless", "to-file", "loop", "svg"]
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"{image_server}/{n}.png"}},
                                                   {"type": "text", "text": f"what is {n}?"}]}]}
        for n in names
    ]  # fmt: skip
    src = {"name": "web", "path": jsonl(tmp_path / "w.jsonl", rows), "format": "messages"}
    # refused by default: nothing fetched; a source with nothing left is loud, not an empty run
    with pytest.raises(ConfigError, match="points off the machine; refused"):
        prepare(write_mix(tmp_path, [src], {"max_image_bytes": 100_000}), tmp_path / "data-off")
    assert _ImageServer.requests == []
    # allowed: the good image and the one behind a redirect are kept (stored once: same bytes); the rest say why
    mix = write_mix(
        tmp_path, [src], {"allow_remote": True, "max_image_bytes": 100_000, "remote_timeout_s": 5}
    )
    manifest, layout = prepare(mix, tmp_path / "data-on")
    assert manifest.sources["web"].kept == 2 and manifest.sources["web"].images_stored == 1
    reasons = {
        rows[q["row_index"]]["messages"][0]["content"][1]["text"]: q["reason"] for q in quarantine(layout)
    }
    assert "answered HTTP 404" in reasons["what is 404?"]
    assert "image too large (10000000000 bytes > max_image_bytes 100000)" in reasons["what is huge?"]
    assert "more than max_image_bytes 100000" in reasons["what is endless?"]
    assert "only http(s) is followed" in reasons["what is to-file?"]
    assert "redirects more than 3 times" in reasons["what is loop?"]
    assert "an SVG" in reasons["what is svg?"]
    assert "/cat.png" in _ImageServer.requests


def test_a_200_mb_image_file_is_refused_at_the_default_bound(tmp_path):
    big = tmp_path / "huge.png"
    with open(big, "wb") as f:  # sparse: 200 MB on paper, nothing on disk; a read would still take 200 MB
        f.write(image_bytes())
        f.truncate(200_000_000)
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "huge.png"}},
                                                   {"type": "text", "text": "what?"}]}]},
        {"messages": [{"role": "user", "content": "a good row"}]},
    ]  # fmt: skip
    src = {"name": "big", "path": jsonl(tmp_path / "b.jsonl", rows), "format": "messages"}
    manifest, layout = prepare(write_mix(tmp_path, [src], {}), tmp_path / "data")
    (q,) = quarantine(layout)
    assert "image too large (200000000 bytes > max_image_bytes 20000000)" in q["reason"]
    assert manifest.sources["big"].kept == 1
