"""The trainer's held-out set: which rows of a shard are never trained on, and the bounded eval samples.

The rule is schemas.heldout (a hash of split seed and prompt id); this module applies it to an output
shard (`split_table`: the rows to train on, and the held-out rows per source) and keeps what the
evaluation scores (`EvalSet`): up to `eval_max_samples` held-out samples in the order their shards were
trained, each cut at `eval_max_length`, with its source. The set is saved in every checkpoint (int32 ids,
a few MB at most), so a resumed trainer scores the same samples without re-reading consumed shards, and
the split (fraction, seed, version) is saved beside it: a resume with another split is refused, since
prompts the draft was trained on would then be scored as unseen. It also notes every source the run
trained on, so a source with no held-out prompt is named once. Scoring is evaluate.py's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pyarrow as pa
import torch

from regen_service.errors import ConfigError
from regen_service.train.vl_samples import VlContext
from schemas.heldout import SPLIT_VERSION, HeldOutSplit

log = logging.getLogger(__name__)

NO_SOURCE = "(none)"  # rows written without a source field


def split_of(cfg) -> HeldOutSplit:
    return HeldOutSplit(fraction=cfg.evaluation.eval_fraction, seed=cfg.evaluation.eval_seed)


def split_table(table: pa.Table, split: HeldOutSplit) -> tuple[pa.Table, dict[str, pa.Table], dict]:
    """-> (rows to train on, held-out rows per source, trained rows per source). A row without a
    prompt id is trained on (nothing says which side it belongs to)."""
    n = table.num_rows
    ids = table.column("prompt_id").to_pylist() if "prompt_id" in table.column_names else [None] * n
    srcs = table.column("source").to_pylist() if "source" in table.column_names else [None] * n
    held = [pid is not None and split.holds_out(pid) for pid in ids]
    train = table.filter(pa.array([not h for h in held], pa.bool_()))
    by_source: dict[str, list[int]] = {}
    trained: dict[str, int] = {}
    for i, (h, s) in enumerate(zip(held, srcs, strict=True)):
        if h:
            by_source.setdefault(s or NO_SOURCE, []).append(i)
        else:
            trained[s or NO_SOURCE] = trained.get(s or NO_SOURCE, 0) + 1
    return train, {s: table.take(pa.array(rows, pa.int64())) for s, rows in by_source.items()}, trained


@dataclass
class EvalSample:
    ids: torch.Tensor  # int64 [T]
    mask: torch.Tensor  # int64 [T], 1 on assistant tokens
    source: str
    vl: VlContext | None = None  # the images in its context (vl_samples.py): scored through the engine


class EvalSet:
    """The held-out samples the evaluation scores, bounded, identical on every rank (each rank adds a
    shard's held-out samples when it trains that shard, in the same order)."""

    def __init__(self, cfg):
        self.split = split_of(cfg)
        self.max_samples, self.max_length = cfg.evaluation.eval_max_samples, cfg.evaluation.eval_max_length
        self.samples: list[EvalSample] = []
        self.trained_sources: dict[str, int] = {}  # prompts trained per source
        self.held_sources: dict[str, int] = {}  # held-out prompts seen per source (kept or not)
        self._named: set[str] = set()  # sources already reported as having no held-out prompt

    @property
    def enabled(self) -> bool:
        return self.split.fraction > 0

    def add(self, held: dict[str, list], trained: dict[str, int], held_rows: dict[str, int]) -> None:
        """A trained shard's held-out examples per source (data.Example), its trained and held-out row
        counts per source."""
        for s, n in trained.items():
            self.trained_sources[s] = self.trained_sources.get(s, 0) + n
        for s, n in held_rows.items():
            self.held_sources[s] = self.held_sources.get(s, 0) + n
        for source in sorted(held):
            for ex in held[source]:
                if len(self.samples) >= self.max_samples:
                    return
                ids, mask = ex.ids[: self.max_length], ex.mask[: self.max_length]
                if ids.numel() >= 2 and int(mask[1:].sum()):
                    self.samples.append(EvalSample(ids, mask, source, getattr(ex, "vl", None)))

    def sources_without_eval(self) -> list[str]:
        """Sources trained on with no held-out prompt so far, each named (logged) once."""
        missing = sorted(s for s in self.trained_sources if s not in self.held_sources)
        for s in missing:
            if s not in self._named:
                self._named.add(s)
                log.warning(
                    "held-out split: source %r has no held-out prompt (%d trained, eval_fraction %s): its "
                    "accept length cannot be reported; raise eval_fraction in train.yaml (or add prompts)",
                    s, self.trained_sources[s], self.split.fraction,
                )  # fmt: skip
        return missing

    # --- checkpoint ------------------------------------------------------------------------------
    def state(self) -> dict:
        return {
            "split": self.split.model_dump(),
            "samples": [
                {"ids": s.ids.to(torch.int32), "mask": s.mask.to(torch.int8), "source": s.source}
                | ({"vl": s.vl.as_dict()} if s.vl else {})
                for s in self.samples
            ],
            "trained_sources": dict(self.trained_sources),
            "held_sources": dict(self.held_sources),
        }

    def load(self, state: dict | None, where: str, had_ckpt: bool) -> None:
        """Restore from a checkpoint; refuse one trained with another split."""
        if not had_ckpt:
            return
        # a checkpoint from before the split existed trained on every prompt: fraction 0
        saved = (state or {}).get("split") or {"fraction": 0.0, "seed": 0, "version": SPLIT_VERSION}
        mine = self.split.model_dump()
        if (saved["fraction"], saved["seed"], saved["version"]) != (
            mine["fraction"],
            mine["seed"],
            mine["version"],
        ) and not (saved["fraction"] == 0 and mine["fraction"] == 0):
            raise ConfigError(
                f"{where}: the checkpoint was trained with held-out split fraction {saved['fraction']}, seed "
                f"{saved['seed']} (rule v{saved['version']}); this config asks fraction {mine['fraction']}, seed "
                f"{mine['seed']} (v{mine['version']}), so prompts it trained on would be scored as held out. Set "
                f"eval_fraction: {saved['fraction']} and eval_seed: {saved['seed']} in train.yaml, or train into a new --out"
            )
        state = state or {}
        self.samples = [
            EvalSample(
                s["ids"].to(torch.int64),
                s["mask"].to(torch.int64),
                s["source"],
                VlContext.from_dict(s.get("vl")),
            )
            for s in state.get("samples", [])
        ]
        self.trained_sources = dict(state.get("trained_sources", {}))
        self.held_sources = dict(state.get("held_sources", {}))
