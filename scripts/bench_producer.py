"""Time prepare_run on a synthetic mix shaped like the real one: ~83,000 prompts in 10 sources, 5 formats.

Writes the sources to a temporary folder (two per format, .jsonl/.json/.parquet mixed, a few percent
duplicates and bad rows), runs prepare_run against a local data root, and prints JSON with the
timings and counts. Nothing here is used by the service; it is the producer's speed check.

Run: python scripts/bench_producer.py [--rows 83000]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from regen_service.produce.prepare import prepare_run, run_id_for
from regen_service.state.storage import Storage
from schemas.mix import parse_mix

WORDS = "alpha beta gamma delta river stone cloud lamp garden query vector kernel tide maple orbit".split()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _row(fmt: str, rng: random.Random, i: int) -> dict:
    if fmt == "sharegpt":
        turns = []
        for _ in range(rng.randint(1, 3)):
            turns += [{"from": "human", "value": _text(rng, 30)}, {"from": "gpt", "value": _text(rng, 80)}]
        return {"conversations": turns, "system": "Be helpful." if i % 5 == 0 else None}
    if fmt == "messages":
        call = {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": {"x": i}}}
        return {
            "messages": [
                {"role": "user", "content": _text(rng, 30)},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "{}", "tool_call_id": f"c{i}"},
                {"role": "assistant", "content": _text(rng, 60)},
            ],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        }
    if fmt == "instruction":
        return {
            "instruction": _text(rng, 20),
            "input": _text(rng, 20) if i % 2 else "",
            "output": _text(rng, 80),
        }
    if fmt == "prompt_response":
        return {"prompt": _text(rng, 60), "response": _text(rng, 40) + "<|endoftext|>"}
    ids = [rng.randrange(6000) for _ in range(rng.randint(64, 512))]
    return {"input_ids": ids, "loss_mask": [i % 2 for i in range(len(ids))]}


def write_sources(folder: Path, total: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    formats = ["sharegpt", "messages", "instruction", "prompt_response", "pretokenized"]
    sources = []
    for k in range(10):
        fmt = formats[k % 5]
        rows = [_row(fmt, rng, i) for i in range(total // 10)]
        for j in range(
            50, len(rows), 50
        ):  # ~2% duplicates, ~1% bad rows (never the first: it fixes the parquet schema)
            rows[j] = rows[j - 1]
            if j % 100 == 0:
                rows[j] = {"unexpected": j}
        ext = [".jsonl", ".parquet", ".json"][k % 3] if fmt != "pretokenized" else ".parquet"
        path = folder / f"src{k}{ext}"
        if ext == ".parquet":
            pq.write_table(pa.Table.from_pylist(rows), path)
        elif ext == ".json":
            path.write_text(json.dumps(rows))
        else:
            path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        sources.append({"name": f"src{k}", "path": path.name, "format": fmt})
    return sources


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=83_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "mix"
        folder.mkdir()
        t0 = time.perf_counter()
        sources = write_sources(folder, args.rows)
        t1 = time.perf_counter()
        mix_data = {"name": "bench", "target": {"model": "m"}, "shard_size": 256, "sources": sources}
        mix = parse_mix(mix_data, base_dir=str(folder))
        run_id = run_id_for(mix)
        t2 = time.perf_counter()
        manifest = prepare_run(mix, Storage(str(Path(tmp) / "data")), run_id, json.dumps(mix_data))
        t3 = time.perf_counter()
    stats = {k: v.model_dump() for k, v in manifest.sources.items()}
    print(
        json.dumps(
            {
                "rows": sum(s["read"] for s in stats.values()),
                "prompts": manifest.num_prompts,
                "shards": manifest.num_shards,
                "write_sources_s": round(t1 - t0, 2),
                "run_id_s": round(t2 - t1, 3),
                "prepare_run_s": round(t3 - t2, 2),
                "sources": stats,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
