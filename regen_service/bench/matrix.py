"""The quality benchmark's matrix: which drafts to train, and training and scoring one of them.

`Bench.open` loads what every cell shares from a work folder that quality.make_runs filled (the target,
the two runs' examples, the held-out eval samples and decode prompts), so a cell can run in a process
of its own (jobs.py runs several at once on one GPU). `plan` lists the cells in the order that matters
(seed 0 before seed 1, the largest size first, SpecForge beside regen at the largest), and `run_cell`
trains one for exactly `steps` steps (offline.train_draft, or SpecForge's trainer) and scores it by
the trainer's simulated accept length (evaluate.py) and by real speculative decoding (specdecode.py),
overall and per source. Building the target and the runs is quality.py's; scheduling is jobs.py's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from regen_service.bench import quality
from regen_service.errors import ConfigError
from regen_service.train import offline, specdecode
from regen_service.train.config import TrainConfig
from regen_service.train.eval_set import EvalSample, split_of
from regen_service.train.evaluate import evaluate


@dataclass(frozen=True)
class Cell:
    trainer: str  # "regen" | "specforge"
    data: str  # "regen" (the target's answers) | "orig" (the files' own answers)
    size: int
    seed: int

    @property
    def key(self) -> str:
        return f"{self.trainer}-{self.data}-{self.size}-s{self.seed}"

    @classmethod
    def parse(cls, key: str) -> Cell:
        trainer, data, size, seed = key.split("-")
        return cls(trainer, data, int(size), int(seed.removeprefix("s")))


def plan(sizes: list[int], seeds: list[int], specforge: bool) -> list[Cell]:
    """Every cell, the ones a partial run most needs first: per seed, the largest size's regen/orig/SpecForge."""
    cells = []
    for seed in seeds:
        for size in sorted(sizes, reverse=True):
            cells += [Cell("regen", "regen", size, seed), Cell("regen", "orig", size, seed)]
            if size == max(sizes) and specforge:
                cells.append(Cell("specforge", "regen", size, seed))
    return cells


@dataclass
class Bench:
    target: object
    tok: object
    ctx: object
    base: dict  # TrainConfig fields shared by every cell (the seed is the cell's)
    data: dict  # {"orig"|"regen": {prompt_id: (source, Example)}} to train on
    common: list[str]  # prompt ids both runs answered, in a fixed order: a size takes a prefix
    evalset: list[EvalSample]
    decode: tuple[list, list]  # held-out prompt ids and their sources, for real decoding
    specforge_root: str | None = None

    @classmethod
    def open(
        cls, runs: dict, storage, target, tok, ctx, base: dict, decode_per_source: int, specforge_root=None
    ):
        cfg0 = TrainConfig(**base)
        rf = renderer_factory(tok)
        data, held = {}, {}
        for kind in ("orig", "regen"):
            data[kind], held[kind] = offline.run_examples(storage, runs[kind], rf, cfg0)
        common = sorted(set(data["orig"]) & set(data["regen"]))
        evalset = offline.eval_samples(
            held["regen"], cfg0.evaluation.eval_max_samples, cfg0.evaluation.eval_max_length
        )
        dp, dsrc, _ = quality.heldout_prompts(storage, runs["regen"], split_of(cfg0), tok, decode_per_source)
        return cls(target, tok, ctx, base, data, common, evalset, (dp, dsrc), specforge_root)

    def sizes(self, asked: list[int]) -> list[int]:
        if len(self.common) < min(asked):
            raise ConfigError(
                f"only {len(self.common)} prompts to train on, fewer than the smallest size {min(asked)}; "
                "lower --sizes or add held-out packages (--held-out)"
            )
        return sorted({min(s, len(self.common)) for s in asked})

    def run_cell(
        self, cell: Cell, steps: int, ks: list[int], new_tokens: int, crosscheck: bool = False
    ) -> dict:
        cfg = TrainConfig(**{**self.base, "seed": cell.seed})
        exs = [self.data[cell.data][pid][1] for pid in self.common[: cell.size]]
        d2t, t2d, vstats = offline.vocab_for(exs, self.target.vocab_size, cfg.model.draft_vocab_size)
        rec = {"key": cell.key, "trainer": cell.trainer, "data": cell.data, "size": cell.size, "seed": cell.seed,
               "steps": steps, "batch": cfg.data.batch_size, "lr": cfg.optimisation.lr, "vocab": vstats}  # fmt: skip
        if cell.trainer == "regen":
            tr, summ = offline.train_draft(self.target, exs, (d2t, t2d), cfg, steps, self.ctx)
            draft = tr.draft
        else:
            from regen_service.train.peer_specforge import train_specforge
            from regen_service.train.trainer import draft_config_for

            dc = draft_config_for(self.target.text_config, cfg.model)
            draft, summ = train_specforge(
                self.specforge_root, self.target, dc, (d2t, t2d), exs, cfg, steps, self.ctx.device
            )
        rec.update(summ)
        self.score(draft, cfg, rec, ks, new_tokens, crosscheck)
        return rec

    def score(self, draft, cfg, rec: dict, ks: list[int], new_tokens: int, crosscheck: bool) -> None:
        t1 = time.perf_counter()
        sim = evaluate(draft, self.target, self.evalset, cfg, self.ctx)
        rec["sim"] = {k: sim["accept_length"][str(k)] for k in ks}
        rec["sim_walk"] = {k: sim["accept_length_walk"][str(k)] for k in ks}
        rec["sim_sources"] = {
            s: {k: r["accept_length"][str(k)] for k in ks} for s, r in sim["sources"].items()
        }
        rec["acc"], rec["target_entropy"] = sim["acc"], sim["target_entropy"]
        rec["real"], rec["real_sources"] = {}, {}
        dp, dsrc = self.decode
        eos = self.tok.eos_token_id
        for k in ks:
            out = specdecode.accept_lengths(self.target, draft, dp, dsrc, k, new_tokens, eos)
            rec["real"][k], rec["real_sources"][k] = out["accept_length"], out["sources"]
            if crosscheck and k == max(ks):  # the simulated figures on the target's own greedy text
                greedy = [EvalSample(torch.tensor(p + g), torch.tensor([0] * len(p) + [1] * len(g)), s)
                          for p, g, s in zip(dp, out["generated"], dsrc, strict=True) if len(g) > 1]  # fmt: skip
                g = evaluate(draft, self.target, greedy, cfg, self.ctx)
                rec["crosscheck_greedy_sim"] = {kk: g["accept_length"][str(kk)] for kk in ks}
                rec["crosscheck_greedy_walk"] = {kk: g["accept_length_walk"][str(kk)] for kk in ks}
        rec["score_s"] = round(time.perf_counter() - t1, 1)


def renderer_factory(tok):
    from regen_service.train.data import ChatRenderer

    cache = []

    def factory():
        if not cache:
            cache.append(ChatRenderer(tok))
        return cache[0]

    return factory


def work_paths(work: Path) -> dict[str, Path]:
    return {"target": work / "target", "target_report": work / "target_report.json", "results": work / "results.jsonl",
            "logs": work / "logs"}  # fmt: skip
