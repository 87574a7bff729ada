"""The simulator takes images as a vision-language server does, over real HTTP to a `regen sim` process:
image parts in chat content and SGLang's `image_data` on /generate, each image decoded and counted as
prompt tokens (ceil(w/28) * ceil(h/28)); a bad payload or a placeholder count that does not match is a 400.
"""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image

from tests.procs import sim_server

MEDIA = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\n"


def png(w: int, h: int, colour=(10, 120, 200)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def parts(url: str, text: str = "What is in the picture?") -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]


@pytest.fixture(scope="module")
def sim():
    with sim_server("--decode-tok-s", "0", "--answer-len-mean", "8", "--answer-len-max", "16") as url:
        yield url


def chat(sim: str, content, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_completion_tokens": 8, **extra}
    return httpx.post(f"{sim}/v1/chat/completions", json=body, timeout=30)


def test_chat_image_counts_its_tokens_and_changes_the_answer(sim):
    text_only = chat(sim, "What is in the picture?").json()["usage"]["prompt_tokens"]
    small = chat(sim, parts(png(28, 28))).json()
    big = chat(sim, parts(png(100, 60))).json()
    # the rendered placeholder is one token of the text; the image replaces it with its tokens
    assert small["usage"]["prompt_tokens"] - big["usage"]["prompt_tokens"] == 1 - 4 * 3
    assert small["usage"]["prompt_tokens"] > text_only
    other = chat(sim, parts(png(100, 60, (200, 0, 0)))).json()
    assert other["choices"][0]["message"] != big["choices"][0]["message"]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("images/ab.png", "invalid base64"),
        ("data:image/png,abc", "only base64 data URLs"),
        ("data:image/png;base64,not*base64", "invalid base64"),
        ("data:image/png;base64," + base64.b64encode(b"<svg></svg>").decode(), "cannot identify"),
        ("https://example.com/cat.png", "fetches no image URLs"),
    ],
)
def test_chat_bad_image_is_a_400(sim, url, says):
    r = chat(sim, parts(url))
    assert r.status_code == 400 and says in r.json()["message"]
    assert r.json()["message"].startswith("messages[0].content[0].image_url.url")


def test_chat_unknown_part_type_is_a_400(sim):
    r = chat(sim, [{"type": "input_audio", "input_audio": {}}, {"type": "text", "text": "hi"}])
    assert r.status_code == 400 and "unsupported content part type" in r.json()["message"]


def test_generate_image_data_matches_placeholders(sim):
    text = f"<|im_user|>user<|im_middle|>{MEDIA}Describe it.<|im_end|><|im_assistant|>assistant<|im_middle|>"
    plain = httpx.post(f"{sim}/generate", json={"text": text}, timeout=30).json()
    one = httpx.post(f"{sim}/generate", json={"text": text, "image_data": [png(56, 56)]}, timeout=30).json()
    assert one["meta_info"]["prompt_tokens"] == plain["meta_info"]["prompt_tokens"] + 4 - 1
    # a bare base64 string is an image too (SGLang's load_image)
    bare = png(56, 56).split(",", 1)[1]
    same = httpx.post(f"{sim}/generate", json={"text": text, "image_data": bare}, timeout=30).json()
    assert same["output_ids"] == one["output_ids"]
    two = httpx.post(f"{sim}/generate", json={"text": text, "image_data": [png(8, 8)] * 2}, timeout=30)
    assert two.status_code == 400 and "1 image placeholder(s)" in two.json()["error"]["message"]
    bad = httpx.post(f"{sim}/generate", json={"text": text, "image_data": ["data:image/png;base64,AAAA"]})
    assert bad.status_code == 400 and "cannot identify" in bad.json()["error"]["message"]
    stats = httpx.get(f"{sim}/sim/stats").json()
    assert stats["images_total"] >= 2 and stats["num_bad_images"] >= 1


def test_generate_input_ids_count_the_placeholder_id(sim):
    ids = [163587, 1001, 163602, 163605, 163604, 1002, 163586]
    r = httpx.post(f"{sim}/generate", json={"input_ids": ids, "image_data": [png(28, 56)]}, timeout=30)
    assert r.status_code == 200 and r.json()["meta_info"]["prompt_tokens"] == len(ids) + 2 - 1


def test_batch_with_image_data_is_refused(sim):
    r = httpx.post(f"{sim}/generate", json={"text": ["a", "b"], "image_data": [png(8, 8)] * 2}, timeout=30)
    assert r.status_code == 400 and "single requests only" in r.json()["error"]["message"]
