"""`regen train`: train the draft from a run's output shards as they land (single process or torchrun).

Rank 0 owns the stream (consumer.ShardFeed) and broadcasts each shard reference; every rank reads
that shard and trains on its stride share (rank::world), all ranks running the same number of steps
(a rank short of data repeats a batch with loss weight 0). The draft vocabulary is counted on rank
0 over the first `vocab_shards` shards (or `vocab_tokens` tokens), broadcast, and frozen. Only rank
0 writes checkpoints, and acks stream entries after the checkpoint listing them exists; a restart
resumes from `latest` (including the batch position inside a shard when checkpoint_every_steps is
set). Target states come from target.HFTarget (a local copy) or engine_target.VllmTarget (a vLLM engine
holding the target), as `target_backend` says.

A shard's file is found from (run, shard) under THIS trainer's data root (RunLayout); the `path` a
stream event carries is never opened (anyone who can write the stream could point it anywhere). A
shard that cannot be read (missing, not Parquet, wrong schema) is logged as an error, recorded in
metrics.jsonl and the checkpoint's `bad_shards`, and acked: it never stops the trainer, restarts
included. Held-out rows (eval_set.split_table) are never trained on; evaluation, the best checkpoint,
trackers and the progress line are monitor.py's.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict
from pathlib import Path

import torch

from regen_service.draft.checkpoint import load_latest, save_checkpoint
from regen_service.errors import ConfigError
from regen_service.remote_code import load_tokenizer, require_opt_in
from regen_service.settings import Settings
from regen_service.state.ledger import Ledger
from regen_service.state.storage import RunLayout, Storage
from regen_service.train import data as D
from regen_service.train import packing
from regen_service.train.config import TrainConfig
from regen_service.train.consumer import ShardFeed, ShardRef, default_consumer_name
from regen_service.train.dist import DistContext, broadcast_object, init_distributed, shutdown
from regen_service.train.eval_set import split_table
from regen_service.train.lengths import bucketer
from regen_service.train.memory import fit_check
from regen_service.train.monitor import Monitor
from regen_service.train.preflight import check_train_config
from regen_service.train.target import VL_NEEDS_ENGINE, HFTarget
from regen_service.train.trainer import DraftTrainer, draft_config_for
from regen_service.train.vocab import VocabCounter, build_vocab, coverage

# What reading a planted or broken shard raises: missing file, not Parquet (ArrowInvalid is a
# ValueError), another schema version (ValueError), missing columns (KeyError), wrong types.
_UNREADABLE = (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError)

log = logging.getLogger(__name__)
TRUST_SETTING = "regen train --trust-remote-code (or trust_remote_code: true in train.yaml)"


def make_target(path: str, cfg: TrainConfig, device, read_image=None):
    """The backend that gives target states: a local HF copy, or the vLLM engine holding the target
    (`read_image`: a stored image's bytes by path, for samples with images)."""
    if cfg.target_states.target_backend == "vllm":
        from regen_service.train.engine_target import VllmTarget

        return VllmTarget(
            path,
            cfg.target_states.target_endpoint,
            device,
            cfg.target_states.aux_layer_ids,
            states_dir=cfg.target_states.target_states_dir,
            num_parallel_requests=cfg.target_states.target_num_parallel_requests,
            request_timeout_s=cfg.target_states.target_request_timeout_s,
            read_image=read_image,
        )
    return HFTarget(
        path,
        device,
        aux_layer_ids=cfg.target_states.aux_layer_ids,
        trust_remote_code=cfg.target_states.trust_remote_code,
    )


def train_from_run(
    settings: Settings,
    run_id: str,
    target_path: str,
    out_dir: str,
    cfg: TrainConfig,
    *,
    follow: bool = False,
    group: str = "trainer",
    consumer: str | None = None,
    device: str | None = None,
) -> dict:
    """Train until the stream has nothing more (with follow: until the run is done). Returns a summary."""
    # Before any weight is loaded or process group started: first whether the folder's code may run at
    # all, then whether the config fits the target.
    require_opt_in(target_path, cfg.target_states.trust_remote_code, TRUST_SETTING)
    check_train_config(cfg, target_path)
    refuse_images_on_hf(settings, run_id, cfg)
    ctx = init_distributed(device)
    finished = False
    try:
        summary = _Run(settings, run_id, target_path, out_dir, cfg, ctx, follow, group, consumer).run()
        finished = True
        return summary
    finally:
        shutdown(ctx, finished)


def refuse_images_on_hf(settings: Settings, run_id: str, cfg: TrainConfig) -> None:
    """A run whose manifest counts image parts cannot train with the HF backend: refused before the
    target loads. (A shard whose rows hold images is refused again when read, for runs whose manifest
    is not on this data root.)"""
    if cfg.target_states.target_backend != "hf":
        return
    layout = RunLayout(Storage(settings.data_root), run_id)
    if not layout.storage.exists(layout.manifest_path):
        return
    images = sum(
        int(s.get("images", 0)) for s in layout.storage.read_json(layout.manifest_path)["sources"].values()
    )
    if images:
        raise ConfigError(f"run {run_id} ({images} image parts): {VL_NEEDS_ENGINE}")


class _Run:
    def __init__(
        self, settings, run_id, target_path, out_dir, cfg, ctx: DistContext, follow, group, consumer
    ):
        self.cfg, self.ctx, self.run_id, self.follow = cfg, ctx, run_id, follow
        self.out = Path(out_dir).resolve()
        self.storage = Storage(settings.data_root)
        self.target = make_target(target_path, cfg, ctx.device, self.storage.read_bytes)
        self.target_path = target_path
        self._renderer = None
        ckpt = load_latest(self.out)
        if ckpt and (
            ckpt["aux_layer_ids"] != self.target.aux_layer_ids
            or ckpt["target_num_layers"] != self.target.num_layers
        ):
            raise ConfigError(
                f"{self.out}: checkpoint was trained on other target layers ({ckpt['aux_layer_ids']})"
            )
        self.consumed: list[tuple[str, int]] = [tuple(k) for k in ckpt["consumed_shards"]] if ckpt else []
        self.in_progress: dict | None = ckpt["in_progress"] if ckpt else None
        self.vocab_stats: dict | None = ckpt.get("vocab_stats") if ckpt else None
        self.bad_shards: list[dict] = list(ckpt.get("bad_shards") or []) if ckpt else []
        self.feed = None
        total, num_shards = cfg.optimisation.total_steps, None
        if ctx.is_main:
            ledger = Ledger(settings)
            name = consumer or default_consumer_name(str(self.out))
            self.feed = ShardFeed(
                ledger, run_id, group, name, cfg.data.claim_idle_s, cfg.data.poll_s, self.storage
            )
            rec = ledger.run_record(run_id)
            num_shards = int(rec["num_shards"]) if rec and rec.get("num_shards") else None
            if total is None:
                if rec is None:
                    raise ConfigError(
                        f"run {run_id} is unknown to the ledger; set total_steps in the train config"
                    )
                total = math.ceil(
                    int(rec["num_prompts"]) * cfg.data.epochs / (cfg.data.batch_size * ctx.world)
                )
        total = broadcast_object(max(1, int(total or 1)), ctx)
        self.trainer = DraftTrainer(
            cfg, draft_config_for(self.target.text_config, cfg.model), self.target.embed_weight, ctx, total
        )
        if ckpt:
            self.trainer.load_state(ckpt)  # its AdamW state is on the device now: the fit check counts it
        # before the first batch: a step that cannot fit is refused here, not run out of memory mid-run
        if cfg.data.fit_check:
            fit = fit_check(
                self.trainer, cfg.data.max_length, cfg.data.batch_size, soft=cfg.optimisation.target == "soft"
            )
            if fit is not None and ctx.is_main:
                log.info("%s", fit.summary())
        self._last_saved_step = self.trainer.step if ckpt else -1
        self.mon = Monitor(self, ckpt, num_shards)  # held-out eval, best checkpoint, trackers, progress
        self._saved_bad = len(self.bad_shards)
        self.metrics_path = self.out / "metrics.jsonl"
        self._cache: dict[str, list[D.Example]] = {}  # rank 0: examples read while picking a shard
        self._schedule_fitted = False

    def _draft_ids(self):
        """Target ids of the draft vocabulary for soft targets (the target's logits over them); None = hard."""
        if self.cfg.optimisation.target != "soft":
            return None
        d = self.trainer.draft
        return d.draft_to_target(torch.arange(d.config.draft_vocab_size, device=d.d2t.device))

    # --- shards -------------------------------------------------------------------------------------
    def _renderer_factory(self):
        if self._renderer is None:
            tok = load_tokenizer(
                self.target_path,
                trust_remote_code=self.cfg.target_states.trust_remote_code,
                setting=TRUST_SETTING,
            )
            self._renderer = D.ChatRenderer(tok)
        return self._renderer

    def _samples(self) -> str:
        if self.cfg.data.samples == "auto":  # follow what the target's template does, decided once
            per_gen = self._renderer_factory().drops_thinking
            data = self.cfg.data.model_copy(
                update={"samples": "per_generation" if per_gen else "conversation"}
            )
            self.cfg = self.cfg.model_copy(update={"data": data})
            log.info("training samples: %s (from the target's chat template)", self.cfg.data.samples)
        return self.cfg.data.samples

    def _examples(self, ref: ShardRef) -> tuple[list[D.Example], dict] | None:
        """The shard's training examples and its held-out ones (never trained on, eval_set.split_table),
        read from our own data root; None (recorded, acked) if unreadable."""
        path = RunLayout(self.storage, ref.run_id).output_shard(ref.shard_id)
        samples = self._samples()  # a tokenizer that cannot load is the config's fault, not the shard's
        try:
            table, held_tables, trained = split_table(self.storage.read_table(path), self.mon.evalset.split)
            image_path = RunLayout(self.storage, ref.run_id).image_path
            examples, stats = D.table_examples(
                table, self._renderer_factory, self.cfg.data.max_length, samples, image_path
            )
            held = {
                "examples": {
                    src: D.table_examples(
                        t, self._renderer_factory, self.cfg.data.max_length, samples, image_path
                    )[0]
                    for src, t in held_tables.items()
                },
                "trained": trained,
                "held_rows": {src: t.num_rows for src, t in held_tables.items()},
            }
        except _UNREADABLE as e:
            if not self.ctx.is_main:
                raise  # rank 0 read the same file first and found it good
            self._bad_shard(ref, path, e)
            return None
        if self.cfg.target_states.target_backend == "hf" and (
            stats["image_rows"] or any(e.vl for exs in held["examples"].values() for e in exs)
        ):
            # before any step: the first shard is read here for the vocabulary, before training starts
            raise ConfigError(f"shard {ref.run_id}/{ref.shard_id}: {VL_NEEDS_ENGINE}")
        if self.ctx.is_main:
            log.info("shard %s/%d: %s, held out %s", ref.run_id, ref.shard_id, stats, held["held_rows"])
        return examples, held

    def _bad_shard(self, ref: ShardRef, path: str, err: BaseException) -> None:
        reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:500]
        log.error(
            "shard %s/%d cannot be trained on and is skipped (%s): %s", ref.run_id, ref.shard_id, path, reason
        )
        rec = {"run_id": ref.run_id, "shard_id": ref.shard_id, "path": path, "reason": reason}
        self.bad_shards.append(rec)
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"bad_shard": rec}) + "\n")
        self.feed.ack({ref.key})  # acked now: a restart must not meet it again

    def _next_local(self) -> ShardRef | None:
        """The next shard not yet consumed whose examples load (cached for the training step)."""
        done = set(self.consumed)
        while (ref := self.feed.next(self.follow)) is not None:
            if ref.key in done:
                self.feed.ack({ref.key})  # checkpointed before a kill, never acked: ack now, do not retrain
                continue
            loaded = self._examples(ref)
            if loaded is not None:
                self._cache[ref.entry_id] = loaded
                return ref
        return None

    # --- main loop ----------------------------------------------------------------------------------
    def run(self) -> dict:
        cache = self._cache
        first: list[ShardRef] = []
        if self.vocab_stats is None:
            vocab = self._build_vocab(first, cache) if self.ctx.is_main else None
            vocab = broadcast_object(vocab, self.ctx)
            if vocab is None:
                return self._close({"steps": 0, "consumed": 0, "checkpoint": None, "reason": "no shards"})
            d2t, t2d, self.vocab_stats = vocab
            self.trainer.set_vocab(d2t, t2d)
        while True:
            ref = (first.pop(0) if first else self._next_local()) if self.ctx.is_main else None
            ref_d = broadcast_object(None if ref is None else asdict(ref), self.ctx)
            if ref_d is None:
                break
            ref = ShardRef(**ref_d)
            examples, held = cache.pop(ref.entry_id) if ref.entry_id in cache else self._examples(ref)
            self.mon.add_shard(held)
            self._train_shard(ref, examples)
            if self.ctx.is_main:
                if self.feed.still_ours(ref):
                    self.consumed.append(ref.key)
                else:
                    log.warning(
                        "shard %s was taken over by another trainer; not recorded as consumed", ref.key
                    )
                if (
                    len(self.consumed) % self.cfg.checkpoints.checkpoint_every_shards == 0
                    or self.mon.best_pending
                ):
                    self._checkpoint(None)
        self.mon.finish()  # the final held-out evaluation (every rank)
        if self.ctx.is_main and (
            self.trainer.step != self._last_saved_step
            or len(self.bad_shards) != self._saved_bad
            or self.mon.best_pending is not None
        ):
            self._checkpoint(None)
        consumed = broadcast_object(len(self.consumed), self.ctx)  # rank 0 alone keeps the list
        latest = self.out / "checkpoints" / "latest"
        return self._close(
            {
                "steps": self.trainer.step,
                "consumed": consumed,
                "checkpoint": latest.read_text().strip() if latest.exists() else None,
                "vocab": self.vocab_stats,
                "bad_shards": len(self.bad_shards),
                # finished in storage, never on the stream (Redis lost them): not "done" while any
                "unannounced_shards": self.feed.unannounced if self.feed is not None else [],
                **self.mon.summary(),
            }
        )

    def _close(self, summary: dict) -> dict:
        if self.feed is not None:
            self.feed.close()
        self.mon.close()
        self.target.close()
        return summary

    def _build_vocab(self, first: list[ShardRef], cache: dict):
        counter = VocabCounter(self.target.vocab_size)
        while len(first) < self.cfg.data.vocab_shards and not (
            self.cfg.data.vocab_tokens and counter.tokens >= self.cfg.data.vocab_tokens
        ):
            ref = self._next_local()
            if ref is None:
                break
            for ex in cache[ref.entry_id][0]:  # training examples only: held-out rows never count
                counter.add(ex.ids, ex.mask)
            first.append(ref)
        if not first:
            return None
        d2t, t2d = build_vocab(counter.counts, self.cfg.model.draft_vocab_size)
        stats = {
            "shards": [list(r.key) for r in first],
            "tokens": counter.tokens,
            "distinct": int((counter.counts > 0).sum()),
            "coverage": round(coverage(counter.counts, t2d), 6),
        }
        log.info("draft vocabulary built and frozen: %s", stats)
        return d2t, t2d, stats

    def _train_shard(self, ref: ShardRef, examples: list[D.Example]) -> None:
        cfg, ctx, tr = self.cfg, self.ctx, self.trainer
        ip = self.in_progress
        epoch0, batch0 = (
            (ip["epoch"], ip["next_batch"]) if ip and (ip["run_id"], ip["shard_id"]) == ref.key else (0, 0)
        )
        self.in_progress = None
        # each batch padded to its length bucket (lengths.py): a bounded set of compiled shapes; or packed
        # rows of max_length tokens (packing.py): one shape
        pad_to = bucketer(cfg.data.length_bucket, cfg.data.max_length)
        packed = cfg.data.packing
        for epoch in range(epoch0, cfg.data.epochs):
            exs = D.shuffled(examples, cfg.data.seed, ref.shard_id, epoch)
            # what the ranks split and batch: samples, or rows of samples (deterministic: every rank packs alike)
            items = packing.pack(exs, cfg.data.max_length) if packed else exs
            if packed:
                self._fit_schedule(len(exs), len(items))
            batches, n = D.rank_batches(items, cfg.data.batch_size, ctx.rank, ctx.world)
            for b in range(batch0 if epoch == epoch0 else 0, n):
                chunk, weight = (batches[b], 1.0) if b < len(batches) else ((batches or [items[:1]])[0], 0.0)
                # the batch on the sequences the target ran (a sample with images: the engine's expanded one)
                docs = samples = None
                if packed:
                    batch, aux, tgt, dl, docs = packing.packed_states(
                        self.target, chunk, self._draft_ids(), cfg.data.max_length
                    )
                    samples = packing.global_batch_docs(items, cfg.data.batch_size, ctx.world, b)
                else:
                    batch, aux, tgt, dl = self.target.example_states(chunk, self._draft_ids(), pad_to)
                real = int(batch["attention_mask"].sum())
                metrics = tr.train_batch(
                    aux, batch["input_ids"], tgt, batch["loss_mask"], weight, dl, real, docs
                )
                if tr.step % cfg.tracking.log_every_steps == 0:
                    self._log(tr.log_record(metrics), ref, epoch)
                best = self.mon.stepped(len(exs), b, samples)  # held-out eval when due (every rank)
                mid_shard = b + 1 < n or epoch + 1 < cfg.data.epochs
                every = cfg.checkpoints.checkpoint_every_steps
                if ctx.is_main and (best or (every and tr.step % every == 0)) and mid_shard:
                    pos = {
                        "run_id": ref.run_id,
                        "shard_id": ref.shard_id,
                        "epoch": epoch,
                        "next_batch": b + 1,
                    }
                    if b + 1 >= n:
                        pos.update(epoch=epoch + 1, next_batch=0)
                    self._checkpoint(pos)

    def _fit_schedule(self, num_samples: int, num_rows: int) -> None:
        """Packed rows, no total_steps: the schedule's estimate counted one sample a step; at the first step of
        a run it is divided by the first shard's samples per row (the same on every rank: same shard, same
        packing). A step later it is left alone: a restart keeps the checkpoint's schedule."""
        if self.cfg.optimisation.total_steps is not None or self.trainer.step or self._schedule_fitted:
            return
        self._schedule_fitted = True
        per_row = num_samples / max(1, num_rows)
        sched = self.trainer.sched.lr_lambdas[0]
        total = math.ceil(sched.total / per_row)
        self.trainer.set_total_steps(total)
        self.mon.schedule_changed()
        if self.ctx.is_main:
            log.info(
                "packed rows hold %.2f samples each on the first shard: schedule length %d steps",
                per_row,
                total,
            )

    def _log(self, rec: dict, ref: ShardRef, epoch: int) -> None:
        if not self.ctx.is_main:
            return
        rec.update(shard=ref.shard_id, epoch=epoch, world=self.ctx.world)
        log.info(
            "step %d loss %.4f acc0 %.3f lr %.2e", rec["step"], rec["loss"], rec.get("acc_0", 0.0), rec["lr"]
        )
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        self.mon.on_log(rec, len(self.consumed))

    def _checkpoint(self, in_progress: dict | None) -> None:
        state = self.trainer.state()
        state.update(
            aux_layer_ids=list(self.target.aux_layer_ids),
            target_num_layers=self.target.num_layers,
            train_config=self.cfg.flat_dict(),  # the flat keys every checkpoint has held
            consumed_shards=[list(k) for k in self.consumed],
            in_progress=in_progress,
            vocab_stats=self.vocab_stats,
            bad_shards=self.bad_shards,
            target_path=str(self.target_path),
            run_id=self.run_id,
            torch_version=str(torch.__version__),  # a plain str: weights_only loads it
            **self.mon.state(),
        )
        path = save_checkpoint(self.out, state, keep=self.cfg.checkpoints.keep_checkpoints)
        self.mon.saved(path.name, self.trainer.step)
        self._last_saved_step = self.trainer.step
        self._saved_bad = len(self.bad_shards)
        acked = self.feed.ack(set(self.consumed))
        log.info("checkpoint %s (%d shards consumed, %d acked now)", path.name, len(self.consumed), acked)
