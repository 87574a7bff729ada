"""The quality benchmark's data and runs: prompts -> producer -> regeneration -> drafts -> accept length.

`make_runs` writes the held-out packages' prompt/answer pairs as prompt_response sources, prepares two
runs from them with regen's producer (`prepare_run`: normalize, content-hash ids, dedup, shards) and
answers both through the Regenerator and the in-process engine: `regen` samples the target as served
(api generate, temperature/top_p of the mix), `orig` replays the files' own answers (tokenized, the
stop token appended), so both land as the same token-exact Parquet rows and differ only in who wrote
the answer. matrix.py trains and scores drafts on subsets of either; jobs.py runs them in parallel.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import yaml

from regen_service.produce.prepare import prepare_run, run_id_for
from regen_service.state.storage import RunLayout, Storage
from regen_service.train import code_prompts as CP
from regen_service.work.chat_template import prompt_ids
from regen_service.work.local_engine import LocalEngine, hf_sampler, replay_sampler
from regen_service.work.local_run import regenerate_run
from schemas.mix import parse_mix
from schemas.prompt_rows import prompts_from_table


def balanced(pairs: list[dict], total: int, seed: int) -> list[dict]:
    """Up to `total` pairs, as even over sources as the sources allow, deterministic."""
    by: dict[str, list[dict]] = {}
    for p in pairs:
        by.setdefault(p["source"], []).append(p)
    rng = random.Random(seed)
    for v in by.values():
        rng.shuffle(v)
    out, i = [], 0
    while len(out) < total and any(i < len(v) for v in by.values()):
        for src in sorted(by):
            if i < len(by[src]) and len(out) < total:
                out.append(by[src][i])
        i += 1
    return out


def mix_for(name: str, sources: dict[str, Path], base: Path, sampling: dict, shard_size: int, tokenizer: str):
    data = {
        "name": name, "target": {"model": "small-target", "api": "generate", "tokenizer": tokenizer},
        "sampling": sampling, "regenerate": {"turns": "all", "thinking": "off"}, "shard_size": shard_size,
        "sources": [{"name": s, "path": str(p), "format": "prompt_response"} for s, p in sorted(sources.items())],
    }  # fmt: skip
    text = yaml.safe_dump(data, sort_keys=False)
    return parse_mix(data, where=name, base_dir=str(base)), text


def make_runs(work: Path, held_files, tok, model, device, n_prompts: int, sampling: dict, seed: int = 0,
              batch_size: int = 4096, max_prompt_tokens: int = 320) -> dict:  # fmt: skip
    """-> {"orig": run_id, "regen": run_id, "storage": Storage, stats...}; reuses finished runs in `work`."""
    t0 = time.perf_counter()
    pairs = CP.pairs_from_files(held_files)
    pairs = [p for p in pairs if len(tok(p["prompt"])["input_ids"]) <= max_prompt_tokens]
    chosen = balanced(pairs, n_prompts, seed)
    srcs = CP.write_jsonl(chosen, work / "prompts")
    storage = Storage(str(work / "data"))
    out = {"pairs_available": len(pairs), "prompts": len(chosen),
           "per_source": {s: sum(p["source"] == s for p in chosen) for s in srcs}}  # fmt: skip
    eos = tok.eos_token_id
    for kind in ("orig", "regen"):
        mix, text = mix_for(f"quality-{kind}", srcs, work, sampling, 2048, tok.name_or_path)
        run_id = run_id_for(mix)
        out[kind] = run_id
        layout = RunLayout(storage, run_id)
        manifest = prepare_run(mix, storage, run_id, text)
        if len(layout.output_shard_ids()) == manifest.num_shards:
            continue
        if kind == "orig":
            answers = {}
            for s in manifest.shards:
                for rec in prompts_from_table(storage.read_table(layout.prompt_shard(s.shard_id))):
                    msgs = rec.conversation.messages
                    ids = prompt_ids(tok, list(msgs[:-1]), None, thinking=False)
                    answers[tuple(ids)] = tok(msgs[-1].content, add_special_tokens=False)["input_ids"] + [eos]
            engine = LocalEngine(replay_sampler(answers), tok, batch_size=1 << 20)
        else:
            engine = LocalEngine(hf_sampler(model, tok, device, seed), tok, batch_size=batch_size)
        out[f"{kind}_regenerate"] = regenerate_run(storage, run_id, mix, engine, tok)
    out["storage"] = storage
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def heldout_prompts(storage: Storage, run_id: str, split, tok, n_per_source: int) -> tuple[list, list, list]:
    """(prompt ids, sources, prompt_id strings) of held-out prompts, up to n per source, sorted by id."""
    layout = RunLayout(storage, run_id)
    recs = []
    for sid in sorted(layout.output_shard_ids()):
        for rec in prompts_from_table(storage.read_table(layout.prompt_shard(sid))):
            if split.holds_out(rec.prompt_id):
                recs.append(rec)
    recs.sort(key=lambda r: r.prompt_id)
    count: dict[str, int] = {}
    ids, sources, pids = [], [], []
    for r in recs:
        if count.get(r.source, 0) >= n_per_source:
            continue
        count[r.source] = count.get(r.source, 0) + 1
        ids.append(prompt_ids(tok, list(r.conversation.messages[:-1]), None, thinking=False))
        sources.append(r.source)
        pids.append(r.prompt_id)
    return ids, sources, pids
