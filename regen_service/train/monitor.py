"""The trainer's watch over its draft: held-out evaluation on schedule, the best checkpoint, trackers, progress.

loop.py calls it at a few points (a shard about to be trained, every step, every log record, every
checkpoint, the end); it owns the eval set (eval_set.py), runs evaluate.py every `eval_every_steps`
and at the end (on every rank together: the evaluation all-reduces its counts), keeps the best result
by accept length at `eval_accept_k` draft tokens and asks for a checkpoint at that step (marked
OUT/checkpoints/best once written), sends train and eval scalars to the trackers (tracking.py, rank 0)
and prints the progress line and the not-learning warning (progress.py). What goes into a checkpoint
of its own: `eval` (the split, the eval set, the best and last results).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from regen_service.draft.checkpoint import mark_best, step_dir_name
from regen_service.train import evaluate as E
from regen_service.train.eval_set import EvalSet
from regen_service.train.progress import Progress, not_learning, warn_not_learning
from regen_service.train.tracking import Trackers, eval_scalars

log = logging.getLogger(__name__)


def batch_samples(n: int, batch_size: int, world: int, b: int) -> int:
    """Samples in global batch b of a shard of n examples split rank::world (every rank's share)."""
    return sum(max(0, min(batch_size, len(range(r, n, world)) - b * batch_size)) for r in range(world))


class Monitor:
    def __init__(self, run, ckpt: dict | None, num_shards: int | None):
        self.run, self.cfg, self.ctx = run, run.cfg, run.ctx
        self.k = min(self.cfg.evaluation.eval_accept_k, self.cfg.optimisation.ttt_length)
        self.evalset = EvalSet(self.cfg)
        saved = (ckpt or {}).get("eval") or {}
        self.evalset.load(saved.get("set"), str(run.out), ckpt is not None)
        self.best: dict | None = saved.get("best")
        self.last: dict | None = saved.get("last")
        self.verdict: dict | None = None
        self.best_pending: int | None = None
        self.samples = int((ckpt or {}).get("samples_seen", 0))
        total = run.trainer.sched.lr_lambdas[0].total
        self.warmup = run.trainer.sched.lr_lambdas[0].warmup
        self.trackers = Trackers(
            self.cfg.tracking.report_to, run.out, f"{run.run_id}-{run.out.name}", self.cfg.flat_dict(),
            enabled=self.ctx.is_main,
        )  # fmt: skip
        self.progress = Progress(total, num_shards, run.follow) if self.ctx.is_main else None
        self._empty_noted = False

    # --- data ---------------------------------------------------------------------------------------
    def add_shard(self, held: dict) -> None:
        """A shard is about to be trained: its held-out samples join the eval set (same order on every rank)."""
        self.evalset.add(held["examples"], held["trained"], held["held_rows"])
        if self.ctx.is_main:
            self.evalset.sources_without_eval()

    def schedule_changed(self) -> None:
        """The schedule's length was re-estimated (packed rows, loop._fit_schedule): progress follows it."""
        sched = self.run.trainer.sched.lr_lambdas[0]
        self.warmup = sched.warmup
        if self.progress is not None:
            self.progress.total = sched.total

    def stepped(self, n_examples: int, b: int, samples: int | None = None) -> bool:
        """After a training step: count its samples (`samples` where the caller counted them: packed rows),
        evaluate when due. True when this step is a new best (the caller checkpoints it)."""
        if samples is None:
            samples = batch_samples(n_examples, self.cfg.data.batch_size, self.ctx.world, b)
        self.samples += samples
        every = self.cfg.evaluation.eval_every_steps
        return bool(every and self.run.trainer.step % every == 0 and self.evaluate())

    # --- evaluation ---------------------------------------------------------------------------------
    def evaluate(self) -> bool:
        """Score the draft on the eval set (collective); True when it is the best so far."""
        step = self.run.trainer.step
        if not self.evalset.enabled or (self.last and self.last.get("step") == step):
            return False
        if not self.evalset.samples:
            if self.ctx.is_main and not self._empty_noted:
                log.warning("held-out eval at step %d skipped: no held-out sample yet (eval_fraction %s)",
                            step, self.cfg.evaluation.eval_fraction)  # fmt: skip
                self._empty_noted = True
            return False
        t0 = time.monotonic()
        res = E.evaluate(self.run.trainer.draft, self.run.target, self.evalset.samples, self.cfg, self.ctx)
        res["step"], res["eval_s"] = step, round(time.monotonic() - t0, 2)
        self.last = res
        al = E.accept_at(res, self.k)
        new_best = al is not None and (self.best is None or al > self.best["accept_length"])
        if new_best:
            self.best = {"step": step, "accept_length": al, "k": self.k, "checkpoint": step_dir_name(step)}
            self.best_pending = step
        if step > self.warmup:
            verdict = not_learning(
                res, self.k, self.run.target.aux_layer_ids, self.run.target.num_layers, self.run.vocab_stats
            )
            if verdict and self.ctx.is_main and self.verdict is None:
                warn_not_learning(verdict, step)
            self.verdict = verdict
        if self.ctx.is_main:
            log.info("held-out eval at step %d: loss %.4f, acc %s, accept length %s (%d samples, %.1f s)", step,
                     res["loss"], res["acc"], res["accept_length"], res["samples"], res["eval_s"])  # fmt: skip
            self.trackers.log(eval_scalars(res), step)
            self.trackers.flush()
        return new_best

    def finish(self) -> None:
        """The end of the run: the final evaluation, and the sources that had no held-out prompt."""
        self.evaluate()
        if self.verdict and self.ctx.is_main:
            warn_not_learning(self.verdict, self.run.trainer.step)
        if self.ctx.is_main:
            self.evalset.sources_without_eval()

    # --- checkpoints, logs, summary -----------------------------------------------------------------
    def state(self) -> dict:
        return {
            "eval": {"set": self.evalset.state(), "best": self.best, "last": self.last},
            "samples_seen": self.samples,
        }

    def saved(self, name: str, step: int) -> None:
        if self.best_pending is not None and self.best_pending == step:
            mark_best(self.run.out, name)
            self.best_pending = None

    def on_log(self, rec: dict, consumed: int) -> None:
        """Rank 0, every log record: trackers and the progress line."""
        tok_s = rec["tok_s_rank"] * self.ctx.world
        train = {f"train/{k}": v for k, v in rec.items() if k.startswith(("loss", "acc_"))}
        train.update({"train/lr": rec["lr"], "train/grad_norm": rec.get("grad_norm"), "train/tokens_per_s": tok_s,
                      "train/samples": self.samples, "train/shards_consumed": consumed})  # fmt: skip
        self.trackers.log(train, rec["step"])
        last = (self.k, E.accept_at(self.last, self.k)) if self.last else None
        line = self.progress.line(
            rec["step"], self.samples, tok_s, consumed, last if last and last[1] else None
        )
        self.progress.show(line)

    def summary(self) -> dict:
        out: dict = {"samples": self.samples, "tracking": self.trackers.active}
        if self.ctx.is_main:
            out["eval"] = self.last
            out["best"] = self.best
            out["not_learning"] = self.verdict
            out["eval_missing_sources"] = sorted(
                s for s in self.evalset.trained_sources if s not in self.evalset.held_sources
            )
            out["tb_dir"] = str(Path(self.run.out) / "tb") if "tensorboard" in self.trackers.active else None
        return out

    def close(self) -> None:
        self.trackers.close()
