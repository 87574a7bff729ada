"""Draft quality on a small real target: original vs regenerated answers, regen's trainer vs SpecForge's.

One command on a GPU machine; JSON lines on stdout (and appended to WORK/results.jsonl, so a call that
runs out of time resumes where it stopped):

    python3 scripts/bench_quality.py --specforge SF_DIR [--sizes 2000,8000,32000 --steps 1000 --seeds 0,1]
    python3 scripts/bench_quality.py --smoke --no-specforge      # CPU: tiny target, tiny corpus, a few steps

Stages: the target (regen_service.train.small_target; skipped when WORK/target holds one), the two runs
(quality.make_runs: producer + Regenerator; `orig` replays the files' answers, `regen` samples the
target at --temperature/--top-p), then per data size (largest first), seed and data kind a regen draft
for --steps steps (offline.train_draft), SpecForge's trainer at the largest regenerated size, each
scored by the trainer's simulated accept length and by real speculative decoding (k in --k) on held-out
prompts. A missing SpecForge checkout, a corpus too small or a target that does not converge stop it
with a message and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from regen_service.errors import ConfigError


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/regen-quality")
    p.add_argument("--smoke", action="store_true")
    p.add_argument(
        "--roots", default=None, help="comma-separated package roots (default: site-packages + stdlib)"
    )
    p.add_argument("--held-out", default="sklearn,pandas,sympy,networkx,statsmodels,matplotlib,skimage")
    p.add_argument("--sizes", default="2000,8000,32000")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--k", default="3,5")
    p.add_argument("--target-steps", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument(
        "--decode-prompts", type=int, default=64, help="held-out prompts per source, real decoding"
    )
    p.add_argument("--decode-new-tokens", type=int, default=96)
    p.add_argument("--specforge", default=None)
    p.add_argument("--no-specforge", action="store_true")
    p.add_argument("--deadline-s", type=float, default=1e9, help="start no new draft after this many seconds")
    p.add_argument("--device", default=None)
    p.add_argument("--jobs", type=int, default=1, help="cells trained at once, each in its own process")
    p.add_argument(
        "--cells", default=None, help="comma-separated cell keys to run, in this order (default: all)"
    )
    p.add_argument("--only", default=None, help=argparse.SUPPRESS)  # a child of --jobs: one cell
    return p.parse_args()


def main() -> int:
    a = parse()
    t_start = time.time()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    from transformers import AutoTokenizer

    from regen_service.bench import jobs, matrix, quality
    from regen_service.state.storage import Storage
    from regen_service.train import small_target
    from regen_service.train.config import TrainConfig
    from regen_service.train.dist import init_distributed
    from regen_service.train.target import HFTarget

    if not a.no_specforge:
        from regen_service.train.peer_specforge import check_checkout

        check_checkout(a.specforge or "")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    paths = matrix.work_paths(work)
    res = jobs.Results(paths["results"])
    ctx = init_distributed(a.device)
    roots, held, recipe = _corpus(a)
    if not paths["target_report"].exists():
        rep = small_target.build_target(roots, held, paths["target"], recipe, device=str(ctx.device))
        paths["target_report"].write_text(json.dumps(rep))
        res.emit({"stage": "target", **rep})
    tok = AutoTokenizer.from_pretrained(paths["target"])
    target = HFTarget(str(paths["target"]), ctx.device)
    sizes = sorted(int(s) for s in a.sizes.split(","))
    seeds = [int(s) for s in a.seeds.split(",")]
    ks = [int(k) for k in a.k.split(",")]
    base = dict(max_length=512, batch_size=a.batch, lr=a.lr, draft_vocab_size=min(8192, len(tok)), min_lr_ratio=0.0,
                eval_fraction=0.05, eval_max_samples=384, eval_max_length=512, log_every_steps=50,
                report_to=["none"], total_steps=a.steps)  # fmt: skip
    runs_file = work / "runs.json"
    if runs_file.exists():  # a child, or a resumed call: the runs are finished Parquet in work/data
        runs = json.loads(runs_file.read_text())
        storage = Storage(str(work / "data"))
    else:
        _, held_files = small_target.corpus_files(roots, held)
        sampling = {"temperature": a.temperature, "top_p": a.top_p, "max_new_tokens": a.max_new_tokens}
        n_prompts = int(max(sizes) / (1 - TrainConfig(**base).evaluation.eval_fraction) * 1.03) + 64
        t0 = time.perf_counter()
        runs = quality.make_runs(work, held_files, tok, target.model, ctx.device, n_prompts, sampling)
        storage = runs.pop("storage")
        res.emit({"stage": "data", **runs, "stage_s": round(time.perf_counter() - t0, 1)})
        runs_file.write_text(json.dumps({"orig": runs["orig"], "regen": runs["regen"]}))
    t0 = time.perf_counter()
    bench = matrix.Bench.open(runs, storage, target, tok, ctx, base, a.decode_prompts, a.specforge)
    sizes = bench.sizes(sizes)
    cells = matrix.plan(sizes, seeds, specforge=not a.no_specforge)
    if a.cells:  # a chosen subset, in the order given (what a short device budget can run first)
        by_key = {c.key: c for c in cells}
        asked = [
            k.replace("-max-", f"-{max(sizes)}-") for k in a.cells.split(",")
        ]  # the largest, however large
        unknown = [k for k in asked if k not in by_key]
        if unknown:
            raise ConfigError(f"--cells {unknown} are not in the plan; the plan's cells: {sorted(by_key)}")
        cells = [by_key[k] for k in asked]
    crosscheck = cells[0].key
    if a.only:
        cell = matrix.Cell.parse(a.only)
        try:
            rec = bench.run_cell(cell, a.steps, ks, a.decode_new_tokens, crosscheck=cell.key == crosscheck)
        except ConfigError:
            raise
        except Exception as e:  # the cell's own failure is a result line; the matrix goes on without it
            res.emit({"key": cell.key, "error": f"{type(e).__name__}: {e}"[:2000]})
            return 1
        rec["setup_s"] = round(time.perf_counter() - t0 - rec.get("train_s", 0) - rec.get("score_s", 0), 1)
        res.emit(rec)
        return 0
    res.emit({"stage": "splits", "train_prompts": len(bench.common), "sizes": sizes, "eval_samples": len(bench.evalset),
              "decode_prompts": len(bench.decode[0]), "cells": [c.key for c in cells]})  # fmt: skip
    todo = [c.key for c in cells if c.key not in res.done]
    if a.jobs > 1:
        del bench  # the children load their own
        argv = [arg for arg in sys.argv if arg != "--only"]
        jobs.run_children(todo, argv, a.jobs, res, paths["logs"], t_start + a.deadline_s)
    else:
        for key in todo:
            if time.time() - t_start > a.deadline_s:
                res.emit({"stage": "stopped", "reason": "deadline", "next": key})
                return 0
            cell = matrix.Cell.parse(key)
            res.emit(bench.run_cell(cell, a.steps, ks, a.decode_new_tokens, crosscheck=key == crosscheck))
    res.emit({"stage": "done", "elapsed_s": round(time.time() - t_start, 1)})
    return 0


def _corpus(a):
    from regen_service.train import small_target

    if a.smoke:
        roots = [Path(sysconfig.get_paths()["stdlib"])]
        held = (
            set(a.held_out.split(","))
            if a.held_out != parse_defaults()["held_out"]
            else {"email", "json", "xml"}
        )
        recipe = small_target.TargetRecipe(vocab_size=2048, hidden=64, layers=4, heads=4, kv_heads=2, intermediate=128,
                                           seq_len=128, batch=8, steps=a.target_steps or 30, lr=3e-3, warmup=5,
                                           tokenizer_sample_bytes=2_000_000, corpus_bytes=3_000_000,
                                           max_perplexity=2000.0, eval_tokens=20_000)  # fmt: skip
        return roots, held, recipe
    roots = [Path(r) for r in a.roots.split(",")] if a.roots else _default_roots()
    return roots, set(a.held_out.split(",")), small_target.TargetRecipe(steps=a.target_steps or 2000)


def parse_defaults() -> dict:
    return {"held_out": "sklearn,pandas,sympy,networkx,statsmodels,matplotlib,skimage"}


def _default_roots() -> list[Path]:
    import site

    return [Path(p) for p in site.getsitepackages() if Path(p).is_dir()] + [
        Path(sysconfig.get_paths()["stdlib"])
    ]


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as e:
        print(f"bench_quality: {e}", file=sys.stderr)
        sys.exit(2)
