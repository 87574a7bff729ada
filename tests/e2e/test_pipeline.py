"""End to end through the real parts: producer -> Redis -> a Celery worker process -> the simulator over
HTTP -> Parquet shards read back with pyarrow and `datasets`."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import pytest
import yaml

from regen_service.produce.producer import enqueue
from regen_service.state.ledger import Ledger
from regen_service.state.runinfo import load_manifest
from regen_service.state.status import JSON_KEYS, run_status
from regen_service.state.storage import RunLayout, Storage
from schemas.tables import SCHEMA_VERSION, SCHEMA_VERSION_KEY
from tests.procs import regen_cmd, sim_server, wait_run_done, worker_process

DEMO = Path(__file__).resolve().parents[2] / "regen_service" / "demo"


def demo_mix(tmp_path: Path, api: str, name: str) -> Path:
    """The bundled five-format mix (with its planted bad rows), pointed at by absolute paths."""
    data = yaml.safe_load((DEMO / "mix.yaml").read_text())
    data["name"] = name
    data["target"]["api"] = api
    data["target"]["tokenizer"] = str(DEMO / "tokenizer")
    for src in data["sources"]:
        src["path"] = str(DEMO / src["path"])
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def read_outputs(settings, run_id: str):
    layout = RunLayout(Storage(settings.data_root_resolved), run_id)
    files = sorted(p for p in layout.storage.ls(layout.outputs_dir) if p.endswith(".parquet"))
    return layout, files


@pytest.mark.parametrize("api", ["generate", "chat"])
def test_mix_of_five_formats_end_to_end(settings, settings_env, tmp_path, api):
    mix = demo_mix(tmp_path, api, f"e2e-{api}")
    sim_args = ["--tokenizer", str(DEMO / "tokenizer"), "--decode-tok-s", "0", "--think-prob", "0.5"]
    with sim_server(*sim_args, log=tmp_path / "sim.log") as url:
        res = enqueue(settings, mix)
        assert res.created and res.num_tasks_sent == res.num_shards > 1
        again = enqueue(settings, mix)
        assert not again.created and again.num_tasks_sent == 0 and again.run_id == res.run_id
        with worker_process(settings_env, url, log=tmp_path / "worker.log") as w:
            st = wait_run_done(settings, res.run_id, procs=(w,))

    layout, files = read_outputs(settings, res.run_id)
    manifest = load_manifest(layout)
    assert len(files) == manifest.num_shards
    for f in files:
        assert pq.read_schema(f).metadata[SCHEMA_VERSION_KEY] == SCHEMA_VERSION.encode()
    ds = datasets.load_dataset("parquet", data_files=files, split="train")
    ids = ds["prompt_id"]
    # every valid prompt exactly once
    assert len(ids) == len(set(ids)) == manifest.num_prompts == st["prompts_total"] == st["prompts_done"]
    prompt_ids = set()
    for sh in manifest.shards:
        prompt_ids |= set(
            pq.read_table(layout.prompt_shard(sh.shard_id), columns=["prompt_id"])["prompt_id"].to_pylist()
        )
    assert set(ids) == prompt_ids
    # planted bad rows are quarantined with reasons
    quarantine = pq.read_table(layout.quarantine_path).to_pylist()
    assert quarantine and all(q["reason"] and q["source"] for q in quarantine)
    assert sum(s.quarantined for s in manifest.sources.values()) == len(quarantine)
    rows = ds.to_list()
    answered = [r for r in rows if r["source"] != "pretok"]
    assert all(r["error"] is None for r in answered)
    assert all(r["turns"] and r["messages"][-1]["role"] == "assistant" for r in answered)
    assert all(r["model"] == "moonshotai/Kimi-K2.5" and r["api"] == api for r in answered)
    if api == "generate":
        assert all(t["output_ids"] for r in answered for t in r["turns"])
        assert all(len(r["input_ids"]) == len(r["loss_mask"]) and sum(r["loss_mask"]) > 0 for r in answered)
    # passthrough rows unchanged
    pretok_src = [
        json.loads(line) for line in (DEMO / "data" / "pretokenized.jsonl").read_text().splitlines()
    ]
    valid = {
        tuple(p["input_ids"]): p["loss_mask"] for p in pretok_src if isinstance(p.get("input_ids"), list)
    }
    pretok_rows = [r for r in rows if r["source"] == "pretok"]
    assert pretok_rows
    for r in pretok_rows:
        assert tuple(r["input_ids"]) in valid and r["loss_mask"] == valid[tuple(r["input_ids"])]
        assert r["turns"] == []
    # status JSON contract
    assert set(JSON_KEYS) <= set(st)
    assert st["state"] == "done" and st["shards_done"] == st["shards_total"] and st["prompts_failed"] == 0
    assert set(st["sources"]) == {name for name, s in manifest.sources.items() if s.kept}
    assert all(s["prompts_done"] == s["prompts_total"] for s in st["sources"].values())
    for name, s in st["sources"].items():
        assert s["state"] == "done" and s["eta_s"] == 0.0
        expected = sum(r["completion_tokens"] or 0 for r in rows if r["source"] == name)
        assert s["tokens_generated"] == expected and (expected > 0) == (name != "pretok")
    assert st["tokens_generated"] == sum(s["tokens_generated"] for s in st["sources"].values())
    # the shard_done stream has one event per shard
    events = Ledger(settings).r.xrange(Ledger(settings).events_key(res.run_id))
    done_events = [e for _, e in events if e["type"] == "shard_done"]
    assert sorted(int(e["shard_id"]) for e in done_events) == list(range(manifest.num_shards))
    assert [e for _, e in events if e["type"] == "run_done"]


def test_status_cli_json(settings, settings_env, tmp_path):
    import subprocess

    mix = demo_mix(tmp_path, "generate", "status-cli")
    res = enqueue(settings, mix)
    out = subprocess.run(regen_cmd("status", res.run_id, "--json"), env={**__import__("os").environ, **settings_env},
                         capture_output=True, text=True, check=True)  # fmt: skip
    st = json.loads(out.stdout)
    assert set(JSON_KEYS) <= set(st)
    assert st["state"] == "queued" and st["prompts_done"] == 0 and st["shards_total"] == res.num_shards
    assert run_status(Ledger(settings), res.run_id)["prompts_total"] == res.num_prompts


def test_bad_mix_names_the_field(tmp_path):
    import subprocess

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({
        "name": "Bad Name", "target": {"model": "m", "api": "generate"}, "shard_size": 0,
        "sources": [{"name": "a", "path": "x.csv", "format": "alpaca", "colour": 1}],
    }))  # fmt: skip
    out = subprocess.run(regen_cmd("enqueue", str(bad)), capture_output=True, text=True)
    assert out.returncode != 0
    for needle in (
        "name:",
        "shard_size",
        "sources.0.format",
        "sharegpt",
        "sources.0.colour",
        "unknown field",
    ):
        assert needle in out.stderr, (needle, out.stderr)
