"""A real vLLM (the CPU build of `make engine`) that cannot take images refuses an image row with a 400,
and the worker records it on the row as a terminal error while the text rows are answered.

The target is the tiny text-only Llama of the engine tests: vLLM parses the chat request's
`image_url` part (a data URL, as regen sends it) and refuses it for a model without image input, the
way a text-only deployment refuses an image mix. Answering images through a vision-language target is
the training side's fixture (issue 24, item 4).
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image

from regen_service.produce.producer import enqueue
from regen_service.state.storage import RunLayout, Storage
from regen_service.train.fixtures import make_tiny_target
from tests.procs import engine_python, vllm_server, wait_run_done, worker_process

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_a_text_only_vllm_refuses_the_image_row_and_answers_the_rest(settings, settings_env, tmp_path):
    engine_python()  # skips (or fails under CI) without the engine environment
    target = make_tiny_target(tmp_path / "target", layers=2, hidden=128, heads=4, kv_heads=2)
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (0, 90, 200)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": "What colour is this?"}]}]},
        {"messages": [{"role": "user", "content": "Say hi."}]},
    ]  # fmt: skip
    (tmp_path / "vl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mix = tmp_path / "mix.yaml"
    mix.write_text(yaml.safe_dump({
        "name": "vl-vllm", "target": {"model": "tiny", "api": "chat"}, "images": {},
        "sampling": {"temperature": 0.0, "max_new_tokens": 8}, "regenerate": {"turns": "last", "thinking": "off"},
        "sources": [{"name": "vl", "path": "vl.jsonl", "format": "messages"}],
    }))  # fmt: skip
    with vllm_server(target, tmp_path / "vllm.log") as engine:
        res = enqueue(settings, mix)
        with worker_process(settings_env, engine, log=tmp_path / "w.log") as w:
            st = wait_run_done(settings, res.run_id, procs=(w,), timeout_s=300)
    layout = RunLayout(Storage(settings.data_root), res.run_id)
    out = {r["row_index"]: r for r in pq.read_table(Path(layout.output_shard(0))).to_pylist()}
    assert st["prompts_failed"] == 1
    assert out[0]["error_class"] == "terminal_row" and "400" in out[0]["error"], out[0]["error"]
    assert out[0]["images"][0]["num_bytes"] == len(buf.getvalue())  # the failed row keeps its prompt
    assert out[1]["error"] is None and out[1]["completion_tokens"] > 0
    print(f"\nvLLM's refusal of the image row: {out[0]['error'][:300]}")
