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
    return p.parse_args()


def main() -> int:
    a = parse()
    t_start = time.perf_counter()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    import torch
    from transformers import AutoTokenizer

    from regen_service.bench import quality
    from regen_service.train import offline, small_target, specdecode
    from regen_service.train.config import TrainConfig
    from regen_service.train.dist import init_distributed
    from regen_service.train.eval_set import EvalSample, split_of
    from regen_service.train.evaluate import evaluate
    from regen_service.train.target import HFTarget

    if not a.no_specforge:
        from regen_service.train.peer_specforge import check_checkout

        check_checkout(a.specforge or "")
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    res = quality.Results(work / "results.jsonl")
    ctx = init_distributed(a.device)
    dev = ctx.device
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
    else:
        roots = [Path(r) for r in a.roots.split(",")] if a.roots else _default_roots()
        held = set(a.held_out.split(","))
        recipe = small_target.TargetRecipe(steps=a.target_steps or 2000)
    tdir = work / "target"
    rep_path = work / "target_report.json"
    if not rep_path.exists():
        rep = small_target.build_target(roots, held, tdir, recipe, device=str(dev))
        rep_path.write_text(json.dumps(rep))
        res.emit({"stage": "target", **rep})
    tok = AutoTokenizer.from_pretrained(tdir)
    target = HFTarget(str(tdir), dev)
    _, held_files = small_target.corpus_files(roots, held)
    sizes = sorted(int(s) for s in a.sizes.split(","))
    seeds = [int(s) for s in a.seeds.split(",")]
    ks = [int(k) for k in a.k.split(",")]
    base = dict(max_length=512, batch_size=a.batch, lr=a.lr, draft_vocab_size=min(8192, len(tok)), min_lr_ratio=0.0,
                eval_fraction=0.05, eval_max_samples=384, eval_max_length=512, log_every_steps=50,
                report_to=["none"], total_steps=a.steps)  # fmt: skip
    cfg0 = TrainConfig(**base)
    sampling = {"temperature": a.temperature, "top_p": a.top_p, "max_new_tokens": a.max_new_tokens}
    n_prompts = int(max(sizes) / (1 - cfg0.evaluation.eval_fraction) * 1.03) + 64
    t0 = time.perf_counter()
    runs = quality.make_runs(work, held_files, tok, target.model, dev, n_prompts, sampling)
    storage = runs.pop("storage")
    res.emit({"stage": "data", **runs, "stage_s": round(time.perf_counter() - t0, 1)})
    rf = _renderer(tok)
    data = {k: offline.run_examples(storage, runs[k], rf, cfg0) for k in ("orig", "regen")}
    common = sorted(set(data["orig"][0]) & set(data["regen"][0]))
    if len(common) < sizes[0]:
        raise ConfigError(f"only {len(common)} prompts to train on, fewer than the smallest size {sizes[0]}")
    sizes = [min(s, len(common)) for s in sizes]
    evalset = offline.eval_samples(
        data["regen"][1], cfg0.evaluation.eval_max_samples, cfg0.evaluation.eval_max_length
    )
    dp, dsrc, _ = quality.heldout_prompts(storage, runs["regen"], split_of(cfg0), tok, a.decode_prompts)
    res.emit({"stage": "splits", "train_prompts": len(common), "sizes": sizes, "eval_samples": len(evalset),
              "decode_prompts": len(dp)})  # fmt: skip

    def score(draft, cfg, rec, crosscheck=False):
        t1 = time.perf_counter()
        sim = evaluate(draft, target, evalset, cfg, ctx)
        rec["sim"] = {k: sim["accept_length"][str(k)] for k in ks}
        rec["sim_sources"] = {
            s: {k: r["accept_length"][str(k)] for k in ks} for s, r in sim["sources"].items()
        }
        rec["acc"], rec["target_entropy"] = sim["acc"], sim["target_entropy"]
        rec["real"], rec["real_sources"] = {}, {}
        for k in ks:
            out = specdecode.accept_lengths(target, draft, dp, dsrc, k, a.decode_new_tokens, tok.eos_token_id)
            rec["real"][k], rec["real_sources"][k] = out["accept_length"], out["sources"]
            if crosscheck and k == max(ks):  # the simulated figure on the target's own greedy text
                greedy = [EvalSample(torch.tensor(p + g), torch.tensor([0] * len(p) + [1] * len(g)), s)
                          for p, g, s in zip(dp, out["generated"], dsrc, strict=True) if len(g) > 1]  # fmt: skip
                g = evaluate(draft, target, greedy, cfg, ctx)
                rec["crosscheck_greedy_sim"] = {kk: g["accept_length"][str(kk)] for kk in ks}
        rec["score_s"] = round(time.perf_counter() - t1, 1)

    plan = []
    for size in sorted(sizes, reverse=True):
        for seed in seeds:
            plan += [("regen", "regen", size, seed), ("regen", "orig", size, seed)]
            if size == max(sizes) and not a.no_specforge:
                plan.append(("specforge", "regen", size, seed))
    vocabs = {}
    for trainer, kind, size, seed in plan:
        key = f"{trainer}-{kind}-{size}-s{seed}"
        if key in res.done:
            continue
        if time.perf_counter() - t_start > a.deadline_s:
            res.emit({"stage": "stopped", "reason": "deadline", "next": key,
                      "elapsed_s": round(time.perf_counter() - t_start, 1)})  # fmt: skip
            return 0
        cfg = TrainConfig(**{**base, "seed": seed})
        exs = [data[kind][0][pid][1] for pid in common[:size]]
        if (kind, size) not in vocabs:
            vocabs[(kind, size)] = offline.vocab_for(exs, target.vocab_size, cfg.model.draft_vocab_size)
        d2t, t2d, vstats = vocabs[(kind, size)]
        rec = {"key": key, "trainer": trainer, "data": kind, "size": size, "seed": seed, "steps": a.steps,
               "batch": a.batch, "lr": a.lr, "vocab": vstats}  # fmt: skip
        if trainer == "regen":
            tr, summ = offline.train_draft(target, exs, (d2t, t2d), cfg, a.steps, ctx)
            draft = tr.draft
        else:
            from regen_service.train.peer_specforge import train_specforge
            from regen_service.train.trainer import draft_config_for

            dc = draft_config_for(target.text_config, cfg.model)
            try:
                draft, summ = train_specforge(a.specforge, target, dc, (d2t, t2d), exs, cfg, a.steps, dev)
            except Exception as e:
                res.emit({**rec, "error": f"{type(e).__name__}: {e}"[:2000]})
                continue
        rec.update(summ)
        score(draft, cfg, rec, crosscheck=(key == f"regen-regen-{max(sizes)}-s{seeds[0]}"))
        res.emit(rec)
        del draft
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    res.emit({"stage": "done", "elapsed_s": round(time.perf_counter() - t_start, 1)})
    return 0


def parse_defaults() -> dict:
    return {"held_out": "sklearn,pandas,sympy,networkx,statsmodels,matplotlib,skimage"}


def _default_roots() -> list[Path]:
    import site

    return [Path(p) for p in site.getsitepackages() if Path(p).is_dir()] + [
        Path(sysconfig.get_paths()["stdlib"])
    ]


def _renderer(tok):
    from regen_service.train.data import ChatRenderer

    cache = []

    def factory():
        if not cache:
            cache.append(ChatRenderer(tok))
        return cache[0]

    return factory


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as e:
        print(f"bench_quality: {e}", file=sys.stderr)
        sys.exit(2)
