"""Image prompts through real workers: requests carry the images, rows carry their references.

Real Redis, a real `regen worker` process, real HTTP to `regen sim` (which decodes every image and
counts its tokens, and answers 400 for one it cannot take). The chat run checks the answered rows read
back with `datasets` (the `images` column, schema version 2); the fault run puts a missing store file,
an altered one, an over-bound request and an image too large for the server's context in one shard,
each failing its row with its reason while the rest is answered (and the over-bound row answered by
`regen retry-failed --include-terminal` on a worker with the default bound); the generate run sends SGLang's
`image_data` beside prompt ids rendered by Kimi-K2.5's template; the reuse run copies an answered
image row into a new run, image included; the S3 run reads the images from a bucket (moto).
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
from pathlib import Path

import datasets
import httpx
import pyarrow.parquet as pq
import yaml
from PIL import Image

from regen_service.produce.producer import enqueue
from regen_service.state.storage import RunLayout, Storage
from schemas.tables import SCHEMA_VERSION_KEY
from tests.procs import regen_cmd, sim_server, wait_run_done, worker_process


def png(w: int, h: int, colour=(0, 90, 200), noise: bool = False) -> bytes:
    im = Image.frombytes("RGB", (w, h), os.urandom(w * h * 3)) if noise else Image.new("RGB", (w, h), colour)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_turn(data: bytes, before: str = "", after: str = "What colour is this?") -> dict:
    content = [{"type": "text", "text": before}] if before else []
    content += [{"type": "image_url", "image_url": {"url": url(data)}}, {"type": "text", "text": after}]
    return {"messages": [{"role": "user", "content": content}]}


def write_mix(tmp_path: Path, rows: list[dict], name: str, **extra) -> Path:
    (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mix = tmp_path / f"{name}.yaml"
    spec = {"name": name, "target": {"model": "moonshotai/Kimi-K2.5"}, "images": {},
            "sampling": {"max_new_tokens": 16},
            "sources": [{"name": "vl", "path": f"{name}.jsonl", "format": "messages"}]} | extra  # fmt: skip
    mix.write_text(yaml.safe_dump(spec))
    return mix


def sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def test_image_prompts_are_answered_and_rows_carry_their_images(settings, settings_env, tmp_path):
    blue, red = png(56, 28), png(6, 6, (200, 0, 0))
    rows = [
        image_turn(blue),
        image_turn(red, before="Look: ", after=" and say what you see."),
        {"messages": [{"role": "user", "content": "Say hi."}]},
        # turns: all answers both assistant turns; each request is the whole conversation, image included
        {"messages": [*image_turn(blue, after="First?")["messages"], {"role": "assistant", "content": "x"},
                      {"role": "user", "content": "And now?"}]},
    ]  # fmt: skip
    mix = write_mix(tmp_path, rows, "vl-chat")
    with sim_server("--decode-tok-s", "0", log=tmp_path / "sim.log") as sim:
        res = enqueue(settings, mix)
        with worker_process(settings_env, sim, log=tmp_path / "worker.log") as w:
            st = wait_run_done(settings, res.run_id, procs=(w,))
        stats = httpx.get(f"{sim}/sim/stats").json()
        body = {"messages": [{"role": "user", "content": "What colour is this?"}], "max_completion_tokens": 1}
        plain = httpx.post(f"{sim}/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
    layout = RunLayout(Storage(settings.data_root_resolved), res.run_id)
    assert st["prompts_failed"] == 0
    assert pq.read_schema(layout.output_shard(0)).metadata[SCHEMA_VERSION_KEY] == b"2"
    out = datasets.load_dataset("parquet", data_files=layout.output_shard(0), split="train")
    assert "images" in out.column_names and all(r["error"] is None and r["turns"] for r in out)
    by_text = {r["messages"][0]["content"]: r for r in out}
    look = by_text["Look:  and say what you see."]["images"]
    assert look == [{"message_index": 0, "offset": len("Look: "), "sha256": sha(red), "media_type": "image/png",
                     "width": 6, "height": 6, "num_bytes": len(red)}]  # fmt: skip
    assert by_text["Say hi."]["images"] is None
    # the server decoded both images (sent once each, one request per row) and counted their tokens:
    # 56x28 is 2 tokens where its placeholder stood
    assert stats["images_total"] == 4 and stats["requests_total"] == 5 and stats["num_bad_images"] == 0
    two = by_text["First?"]
    assert len(two["turns"]) == 2 and two["images"][0]["sha256"] == sha(blue)
    # the image was in the prompt: its rendered placeholder (4 markers and "image") became its 2 tokens
    assert by_text["What colour is this?"]["turns"][0]["prompt_tokens"] == plain + 5 - 1 + 2


def test_image_faults_fail_their_rows_with_reasons(settings, settings_env, tmp_path):
    gone, changed, huge, wide, ok = png(6, 6, (1, 1, 1)), png(6, 6, (2, 2, 2)), png(64, 64, noise=True), \
        png(600, 600, (3, 3, 3)), png(6, 6, (4, 4, 4))  # fmt: skip
    assert len(huge) > 10_000 > len(wide)
    rows = [image_turn(d, after=f"Row {i}.") for i, d in enumerate([gone, changed, huge, wide, ok])]
    rows.append({"messages": [{"role": "user", "content": "Say hi."}]})
    mix = write_mix(tmp_path, rows, "vl-faults")
    # 600x600 is 22*22 = 484 image tokens: beyond this server's context, a 400 on the image's account
    with sim_server("--decode-tok-s", "0", "--context-length", "300", log=tmp_path / "sim.log") as sim:
        res = enqueue(settings, mix)
        layout = RunLayout(Storage(settings.data_root_resolved), res.run_id)
        os.remove(layout.image_path(f"{sha(gone)}.png"))
        Path(layout.image_path(f"{sha(changed)}.png")).write_bytes(png(6, 6, (9, 9, 9)))
        extra = ("--max-request-image-bytes", "10000")
        with worker_process(settings_env, sim, log=tmp_path / "worker.log", extra=extra) as w:
            st = wait_run_done(settings, res.run_id, procs=(w,))
        stats = httpx.get(f"{sim}/sim/stats").json()
        out = {r["messages"][0]["content"] if r["messages"] else r["row_index"]: r
               for r in datasets.load_dataset("parquet", data_files=layout.output_shard(0), split="train")}  # fmt: skip
        # the operator's way out for the bound: a worker allowing more, and retry-failed with terminal rows
        retry = subprocess.run(regen_cmd("retry-failed", res.run_id, "--include-terminal"),
                               env={**os.environ, **settings_env}, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert retry.returncode == 0 and json.loads(retry.stdout)["rows_to_retry"] == 4, retry.stderr[-2000:]
        with worker_process(settings_env, sim, log=tmp_path / "worker-2.log") as w:
            again = wait_run_done(settings, res.run_id, procs=(w,))
        retried = datasets.load_dataset("parquet", data_files=layout.output_shard(0), split="train")
    errors = {r["row_index"]: (r["error_class"], r["error"]) for r in out.values() if r["error"]}
    assert st["prompts_failed"] == 4 and len(out) == 6
    assert errors[0][0] == "terminal_row" and "missing from the run's image store" in errors[0][1]
    assert errors[1][0] == "terminal_row" and "no longer hashes to its name" in errors[1][1]
    assert errors[2][0] == "terminal_row" and "max_request_image_bytes 10000" in errors[2][1]
    assert errors[3][0] == "terminal_row" and "longer than the model's context length" in errors[3][1]
    assert 4 not in errors and 5 not in errors
    # nothing was sent for the three rows the worker refused; the server refused the fourth itself
    assert stats["requests_total"] == 2 and stats["num_context_errors"] == 1
    assert again["prompts_failed"] == 3 and sorted(r["row_index"] for r in retried if r["error"]) == [0, 1, 3]


def test_generate_sends_image_data_beside_the_rendered_prompt(settings, settings_env, tmp_path):
    from regen_service.kimi_fixture import build_kimi_fixture

    kimi = build_kimi_fixture(tmp_path / "Kimi-K2.5")
    img = png(84, 28)
    mix = write_mix(tmp_path, [image_turn(img), {"messages": [{"role": "user", "content": "Say hi."}]}], "vl-gen",
                    target={"model": "moonshotai/Kimi-K2.5", "api": "generate", "tokenizer": str(kimi),
                            "trust_remote_code": True})  # fmt: skip
    # the server has the target's tokenizer, as a real one does: it finds the placeholder by its id
    sim_args = ("--decode-tok-s", "0", "--tokenizer", str(kimi), "--trust-remote-code")
    with sim_server(*sim_args, log=tmp_path / "sim.log") as sim:
        res = enqueue(settings, mix)
        extra = ("--trust-remote-code",)
        with worker_process(settings_env, sim, log=tmp_path / "worker.log", extra=extra) as w:
            st = wait_run_done(settings, res.run_id, procs=(w,))
        stats = httpx.get(f"{sim}/sim/stats").json()
    layout = RunLayout(Storage(settings.data_root_resolved), res.run_id)
    out = datasets.load_dataset("parquet", data_files=layout.output_shard(0), split="train")
    assert st["prompts_failed"] == 0 and stats["images_total"] == 1
    row = next(r for r in out if r["images"])
    turn = row["turns"][0]
    prompt = row["input_ids"][: turn["prompt_len"]]
    pad = json.loads((kimi / "config.json").read_text())["media_placeholder_token_id"]  # <|media_pad|>
    assert prompt.count(pad) == 1
    # token exact: the row's ids are the prompt regen rendered and the server's output ids unchanged
    assert row["input_ids"][turn["prompt_len"] :] == turn["output_ids"]
    # the server counted the image's 3 tokens where its one placeholder stood
    assert turn["prompt_tokens"] == turn["prompt_len"] + 3 - 1


def test_a_reused_image_row_brings_its_image_into_the_new_run(settings, settings_env, tmp_path):
    img = png(6, 6, (7, 70, 170))
    first = write_mix(tmp_path, [image_turn(img)], "vl-reuse")
    with sim_server("--decode-tok-s", "0", log=tmp_path / "sim.log") as sim:
        a = enqueue(settings, first)
        with worker_process(settings_env, sim, log=tmp_path / "worker-a.log") as w:
            wait_run_done(settings, a.run_id, procs=(w,))
        second = write_mix(tmp_path, [image_turn(img), {"messages": [{"role": "user", "content": "Hi."}]}],
                           "vl-reuse")  # fmt: skip
        b = enqueue(settings, second)
        assert b.run_id != a.run_id
        storage = Storage(settings.data_root_resolved)
        lb = RunLayout(storage, b.run_id)
        os.remove(lb.image_path(f"{sha(img)}.png"))  # as if B's store lost it: reuse brings it from A
        with worker_process(settings_env, sim, log=tmp_path / "worker-b.log") as w:
            wait_run_done(settings, b.run_id, procs=(w,))
    out = datasets.load_dataset("parquet", data_files=lb.output_shard(0), split="train")
    reused = [r for r in out if r["reused_from"]]
    assert len(reused) == 1 and reused[0]["reused_from"] == a.run_id
    assert reused[0]["images"][0]["sha256"] == sha(img)
    assert Path(lb.image_path(f"{sha(img)}.png")).read_bytes() == img


def test_images_come_from_an_s3_data_root(settings, settings_env, tmp_path, monkeypatch):
    from tests.s3 import BUCKET, moto_s3

    img = png(28, 28, (5, 50, 150))
    mix = write_mix(tmp_path, [image_turn(img), {"messages": [{"role": "user", "content": "Hi."}]}], "vl-s3")
    with moto_s3(tmp_path) as s3:
        root = f"s3://{BUCKET}/root"
        env = {**settings_env, **s3.env, "REGEN_DATA_ROOT": root}
        s3_settings = settings.model_copy(update={"data_root": root})
        # the producer runs in this process and writes the store the way workers read it
        for k, v in s3.env.items():
            monkeypatch.setenv(k, v)
        res = enqueue(s3_settings, mix)
        since = s3.offset()
        with sim_server("--decode-tok-s", "0", log=tmp_path / "sim.log") as sim:
            with worker_process(env, sim, log=tmp_path / "worker.log") as w:
                st = wait_run_done(s3_settings, res.run_id, procs=(w,))
            stats = httpx.get(f"{sim}/sim/stats").json()
        layout = RunLayout(Storage(root), res.run_id)
        rows = layout.storage.read_table(layout.output_shard(0)).to_pylist()
    assert st["prompts_failed"] == 0 and stats["images_total"] == 1
    assert [r["images"][0]["sha256"] for r in rows if r["images"]] == [sha(img)]
    # the worker read the image from the bucket: one GET of its object
    gets = [p for m, p, _ in s3.requests(since) if m == "GET" and f"images/{sha(img)}.png" in p]
    assert len(gets) == 1
