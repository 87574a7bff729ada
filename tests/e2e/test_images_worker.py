"""An image mix through a real worker today: text rows answered, the image row failed with its reason.

Requests do not carry images yet (issue 24, item 2): a worker must neither send a store path the
server cannot read nor let the target answer a picture it never saw. The row stays in the run,
countable and retryable, and the simulator receives no request for it.
"""

from __future__ import annotations

import base64
import io
import json

import datasets
import httpx
import pyarrow.parquet as pq
import yaml
from PIL import Image

from regen_service.produce.producer import enqueue
from regen_service.state.storage import RunLayout, Storage
from schemas.tables import SCHEMA_VERSION_KEY
from tests.procs import sim_server, wait_run_done, worker_process


def test_an_image_prompt_fails_with_its_reason_and_text_prompts_are_answered(
    settings, settings_env, tmp_path
):
    buf = io.BytesIO()
    Image.new("RGB", (6, 6), (0, 90, 200)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                   {"type": "text", "text": "What colour is this?"}]}]},
        {"messages": [{"role": "user", "content": "Say hi."}]},
        {"messages": [{"role": "user", "content": "Say bye."}]},
    ]  # fmt: skip
    (tmp_path / "vl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mix = tmp_path / "mix.yaml"
    mix.write_text(
        yaml.safe_dump(
            {"name": "vl-worker", "target": {"model": "moonshotai/Kimi-K2.5"}, "images": {},
             "sampling": {"max_new_tokens": 16},
             "sources": [{"name": "vl", "path": "vl.jsonl", "format": "messages"}]}
        )
    )  # fmt: skip
    with sim_server("--decode-tok-s", "0", log=tmp_path / "sim.log") as sim:
        res = enqueue(settings, mix)
        with worker_process(settings_env, sim, log=tmp_path / "worker.log") as w:
            st = wait_run_done(settings, res.run_id, procs=(w,))
        requests = httpx.get(f"{sim}/sim/stats").json()["requests_total"]
    layout = RunLayout(Storage(settings.data_root_resolved), res.run_id)
    assert pq.read_schema(layout.prompt_shard(0)).metadata[SCHEMA_VERSION_KEY] == b"2"
    out = datasets.load_dataset("parquet", data_files=layout.output_shard(0), split="train")
    by_error = {r["error"] is None: r for r in out}
    failed = [r for r in out if r["error"]]
    assert len(out) == 3 and len(failed) == 1 and st["prompts_failed"] == 1
    assert failed[0]["error_class"] == "terminal_row" and "1 image part(s)" in failed[0]["error"]
    assert failed[0]["turns"] == [] and by_error[True]["turns"]
    assert requests == 2  # the two text prompts only
