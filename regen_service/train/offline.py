"""Train a draft on a run's output shards for a fixed number of steps, without Redis: the benchmark's trainer.

`regen train` (runner.py) consumes a stream; a benchmark that compares data sets wants the same
trainer on a chosen set of examples for exactly N steps. This module reads output shards through the
trainer's own pieces (eval_set.split_table for the held-out split, data.table_examples for token ids
and loss masks, vocab.build_vocab, train.DraftTrainer for the step, evaluate.evaluate for the held-out
figures) and loops: epochs over the examples shuffled with the seed, each batch padded to its length
bucket (`length_bucket`, lengths.py, as `regen train` pads: compiled kernels meet a bounded set of
shapes). Nothing in the training step changes.
"""

from __future__ import annotations

import time

import torch

from regen_service.state.storage import RunLayout, Storage
from regen_service.train import data as D
from regen_service.train.dist import DistContext
from regen_service.train.eval_set import EvalSample, split_of, split_table
from regen_service.train.evaluate import evaluate
from regen_service.train.lengths import bucketer
from regen_service.train.trainer import DraftTrainer, draft_config_for
from regen_service.train.vocab import VocabCounter, build_vocab, coverage


def run_examples(storage: Storage, run_id: str, renderer_factory, cfg) -> tuple[dict, dict]:
    """-> ({prompt_id: (source, Example)} to train on, {prompt_id: (source, Example)} held out)."""
    layout = RunLayout(storage, run_id)
    train, held = {}, {}
    for shard_id in sorted(layout.output_shard_ids()):
        table = storage.read_table(layout.output_shard(shard_id))
        tr, held_tables, _ = split_table(table, split_of(cfg))
        for dest, t in [(train, tr), *[(held, h) for h in held_tables.values()]]:
            t = t.filter(t.column("error").is_null()) if "error" in t.column_names else t
            exs, _ = D.table_examples(t, renderer_factory, cfg.data.max_length, "conversation")
            pids = t.column("prompt_id").to_pylist()
            srcs = t.column("source").to_pylist()
            if len(exs) != len(pids):  # a row without loss tokens was dropped: match by re-reading
                exs = [D.table_examples(t.slice(i, 1), renderer_factory, cfg.data.max_length, "conversation")[0]
                       for i in range(t.num_rows)]  # fmt: skip
                for pid, src, e in zip(pids, srcs, exs, strict=True):
                    if e:
                        dest[pid] = (src, e[0])
                continue
            for pid, src, e in zip(pids, srcs, exs, strict=True):
                dest[pid] = (src, e)
    return train, held


def eval_samples(held: dict, max_samples: int, max_length: int) -> list[EvalSample]:
    out = []
    for pid in sorted(held)[:max_samples]:
        src, e = held[pid]
        out.append(EvalSample(e.ids[:max_length], e.mask[:max_length], src))
    return out


def pad_batch(examples: list[D.Example], pad_to: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """The batch padded to a multiple of `pad_to` tokens (SpecForge's trainer, peer_specforge.py)."""
    t = max(e.ids.numel() for e in examples)
    return D.collate(examples, pad_id, pad_to=-(-t // pad_to) * pad_to)


def vocab_for(examples: list[D.Example], vocab_size: int, draft_vocab_size: int):
    counter = VocabCounter(vocab_size)
    for e in examples:
        counter.add(e.ids, e.mask)
    d2t, t2d = build_vocab(counter.counts, draft_vocab_size)
    return d2t, t2d, {"tokens": counter.tokens, "coverage": round(coverage(counter.counts, t2d), 5)}


def draft_ids(draft) -> torch.Tensor:
    return draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device))


def batches(examples: list[D.Example], batch_size: int, steps: int, seed: int):
    """`steps` batches: epochs over the examples, each shuffled with (seed, epoch)."""
    done, epoch = 0, 0
    while done < steps:
        exs = D.shuffled(examples, seed, 0, epoch)
        for i in range(0, len(exs) - batch_size + 1, batch_size):
            if done == steps:
                return
            yield exs[i : i + batch_size]
            done += 1
        epoch += 1


def train_draft(
    target, examples: list[D.Example], vocab, cfg, steps: int, ctx: DistContext,
    evalset: list[EvalSample] | None = None,
) -> tuple[DraftTrainer, dict]:  # fmt: skip
    """Train for exactly `steps` optimizer steps (cosine over `steps`); returns the trainer and a summary."""
    if len(examples) < cfg.data.batch_size:
        raise ValueError(f"{len(examples)} examples, fewer than one batch of {cfg.data.batch_size}")
    tr = DraftTrainer(cfg, draft_config_for(target.text_config, cfg.model), target.embed_weight, ctx, steps)
    tr.set_vocab(*vocab)
    ids = draft_ids(tr.draft) if cfg.optimisation.target == "soft" else None
    pad_to = bucketer(cfg.data.length_bucket, cfg.data.max_length)
    t0 = time.perf_counter()
    log = []
    for batch in batches(examples, cfg.data.batch_size, steps, cfg.data.seed):
        b, aux, tgt, dl = target.example_states(batch, ids, pad_to)
        real = int(b["attention_mask"].sum())
        m = tr.train_batch(aux, b["input_ids"], tgt, b["loss_mask"], 1.0, dl, real)
        if tr.step % cfg.tracking.log_every_steps == 0 or tr.step == steps:
            log.append(
                {
                    "step": tr.step,
                    "loss": round(float(m["loss"]), 4),
                    "acc_0": round(float(m.get("acc_0", 0)), 4),
                }
            )
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t0
    summary = {"steps": tr.step, "train_s": round(train_s, 1), "epochs": round(steps * cfg.data.batch_size / len(examples), 2),
               "log": log[-3:]}  # fmt: skip
    if evalset:
        t1 = time.perf_counter()
        summary["eval"] = evaluate(tr.draft, target, evalset, cfg, ctx)
        summary["eval_s"] = round(time.perf_counter() - t1, 1)
    return tr, summary
