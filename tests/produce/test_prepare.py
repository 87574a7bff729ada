"""The producer's storage half: shards, quarantine, dedup, sampling, run ids, and the bundled demo mix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from regen_service.errors import ConfigError
from regen_service.produce.prepare import prepare_run, run_id_for
from regen_service.state.storage import RunLayout, Storage
from schemas.mix import load_mix
from schemas.prompt_rows import prompts_from_table
from schemas.records import RunManifest

DEMO = Path(__file__).resolve().parents[2] / "regen_service" / "demo"


def write_mix(folder: Path, sources: list[dict], **extra) -> Path:
    data = {"name": "t", "target": {"model": "m"}, "shard_size": 4, "sources": sources, **extra}
    path = folder / "mix.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def jsonl(path: Path, rows: list) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path.name


def qa(i: int) -> dict:
    return {"instruction": f"question {i}", "output": f"answer {i}"}


def prepare(mix_path: Path, root: Path):
    mix = load_mix(mix_path)
    storage = Storage(str(root))
    run_id = run_id_for(mix)
    return prepare_run(mix, storage, run_id, mix_path.read_text()), RunLayout(storage, run_id)


def test_demo_mix_prepares_with_planted_bad_rows_quarantined(tmp_path):
    manifest, layout = prepare(DEMO / "mix.yaml", tmp_path / "data")
    stats = manifest.sources
    assert {k: v.quarantined for k, v in stats.items()} == {
        "chat_sharegpt": 4,
        "tools_messages": 2,
        "alpaca": 1,
        "reading_qa": 1,
        "pretok": 2,
    }
    assert stats["reading_qa"].duplicate == 1  # planted: the same prompt as an alpaca row
    assert manifest.num_prompts == sum(s.kept for s in stats.values()) >= 180
    assert manifest.num_shards == len(manifest.shards) == -(-manifest.num_prompts // 32)
    storage = layout.storage
    quarantine = storage.read_table(layout.quarantine_path).to_pylist()
    assert len(quarantine) == 10 and all(q["reason"] and q["raw"] for q in quarantine)
    records = [
        r
        for s in manifest.shards
        for r in prompts_from_table(storage.read_table(layout.prompt_shard(s.shard_id)))
    ]
    assert len({r.prompt_id for r in records}) == manifest.num_prompts
    assert {r.source for r in records} == set(stats)
    assert any(r.input_ids for r in records) and any(r.num_dropped_parts for r in records)
    assert storage.read_bytes(layout.mix_path) == (DEMO / "mix.yaml").read_bytes()
    mix = load_mix(DEMO / "mix.yaml")
    assert Path(mix.resolve(mix.target.tokenizer), "tokenizer.json").is_file()


def test_counts_dedup_across_sources_and_quarantine_contents(tmp_path):
    a = jsonl(tmp_path / "a.jsonl", [qa(0), qa(1), qa(1), "{broken", [1, 2], qa(2)])
    b_rows = [{"prompt": "question 2", "response": "answer 2"}, {"prompt": "p" * 9000}, {"prompt": 5}]
    pq.write_table(
        pa.Table.from_pylist(
            [
                {
                    "prompt": r["prompt"] if isinstance(r["prompt"], str) else None,
                    "response": r.get("response"),
                }
                for r in b_rows
            ]
        ),
        tmp_path / "b.parquet",
    )
    (tmp_path / "c.json").write_text(json.dumps([{"instruction": "x"}, {"instruction": 3}]))
    mix_path = write_mix(
        tmp_path,
        [
            {"name": "a", "path": a, "format": "instruction"},
            {"name": "b", "path": "b.parquet", "format": "prompt_response"},
            {"name": "c", "path": "c.json", "format": "instruction"},
        ],
    )  # fmt: skip
    manifest, layout = prepare(mix_path, tmp_path / "data")
    got = {
        k: (v.read, v.kept, v.duplicate, v.quarantined, v.sampled_out) for k, v in manifest.sources.items()
    }
    assert got == {"a": (6, 3, 1, 2, 0), "b": (3, 1, 1, 1, 0), "c": (2, 1, 0, 1, 0)}
    q = layout.storage.read_table(layout.quarantine_path).to_pylist()
    assert [(r["source"], r["row_index"]) for r in q] == [("a", 3), ("a", 4), ("b", 2), ("c", 1)]
    assert "not valid JSON" in q[0]["reason"] and q[0]["raw"] == "{broken"
    assert "expected a JSON object, got list" in q[1]["reason"]
    assert "prompt: expected a string, got null" in q[2]["reason"]
    # first occurrence wins: the duplicate in `b` points back to a's row 5
    first = {
        r.prompt_id: (r.source, r.row_index)
        for s in manifest.shards
        for r in prompts_from_table(layout.storage.read_table(layout.prompt_shard(s.shard_id)))
    }
    assert sorted(first.values()) == [("a", 0), ("a", 1), ("a", 5), ("b", 1), ("c", 0)]
    assert [s.num_prompts for s in manifest.shards] == [4, 1]
    assert RunManifest.model_validate(layout.storage.read_json(layout.manifest_path)) == manifest


def test_raw_is_truncated_to_4_kib(tmp_path):
    a = jsonl(tmp_path / "a.jsonl", [qa(0), {"instruction": 1, "pad": "é" * 5000}])
    _, layout = prepare(
        write_mix(tmp_path, [{"name": "a", "path": a, "format": "instruction"}]), tmp_path / "d"
    )
    raw = layout.storage.read_table(layout.quarantine_path).to_pylist()[0]["raw"]
    assert len(raw.encode()) <= 4096 and raw.startswith('{"instruction": 1')


def test_max_samples_is_deterministic_and_seeded(tmp_path):
    a = jsonl(tmp_path / "a.jsonl", [qa(i) for i in range(100)])

    def sampled(seed: int, run: str) -> list[int]:
        mix_path = write_mix(
            tmp_path, [{"name": "a", "path": a, "format": "instruction", "max_samples": 10}], seed=seed
        )
        manifest, layout = prepare(mix_path, tmp_path / run)
        assert (manifest.sources["a"].kept, manifest.sources["a"].sampled_out) == (10, 90)
        recs = [
            r
            for s in manifest.shards
            for r in prompts_from_table(layout.storage.read_table(layout.prompt_shard(s.shard_id)))
        ]
        return sorted(r.row_index for r in recs)

    first = sampled(0, "r1")
    assert first == sampled(0, "r2")
    assert first != sampled(1, "r3")
    assert first != list(range(10))


def test_run_id_follows_mix_and_data(tmp_path):
    a = jsonl(tmp_path / "a.jsonl", [qa(0)])
    mix_path = write_mix(tmp_path, [{"name": "a", "path": a, "format": "instruction"}])
    rid = run_id_for(load_mix(mix_path))
    assert rid.startswith("t-") and len(rid) == len("t-") + 12
    assert run_id_for(load_mix(mix_path)) == rid
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.copy(tmp_path / a, moved / a)
    assert run_id_for(load_mix(write_mix(moved, [{"name": "a", "path": a, "format": "instruction"}]))) == rid
    jsonl(tmp_path / "a.jsonl", [qa(1)])
    assert run_id_for(load_mix(mix_path)) != rid
    assert (
        run_id_for(load_mix(write_mix(tmp_path, [{"name": "a", "path": a, "format": "instruction"}], seed=3)))
        != rid
    )


def test_manifest_written_last_and_rerun_is_a_no_op(tmp_path):
    a = jsonl(tmp_path / "a.jsonl", [qa(i) for i in range(9)])
    mix_path = write_mix(tmp_path, [{"name": "a", "path": a, "format": "instruction"}])
    manifest, layout = prepare(mix_path, tmp_path / "data")
    files = sorted(Path(layout.run_dir).rglob("*"), key=lambda p: p.stat().st_mtime_ns)
    assert files[-1].name == "manifest.json"
    again, _ = prepare(mix_path, tmp_path / "data")
    assert again == manifest


def test_hf_source_with_relative_data_files(tmp_path):
    (tmp_path / "sub").mkdir()
    jsonl(tmp_path / "sub" / "h.jsonl", [{"messages": [{"role": "user", "content": "hello"}]}])
    mix_path = write_mix(
        tmp_path, [{"name": "h", "hf": {"path": "json", "data_files": "sub/h.jsonl"}, "format": "messages"}]
    )
    manifest, _ = prepare(mix_path, tmp_path / "data")
    assert manifest.sources["h"].kept == 1


def test_missing_file_and_empty_result_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        prepare(
            write_mix(tmp_path, [{"name": "a", "path": "nope.jsonl", "format": "instruction"}]),
            tmp_path / "d1",
        )
    a = jsonl(tmp_path / "a.jsonl", [{"bad": 1}])
    with pytest.raises(ConfigError, match="no prompts to regenerate"):
        prepare(write_mix(tmp_path, [{"name": "a", "path": a, "format": "instruction"}]), tmp_path / "d2")
