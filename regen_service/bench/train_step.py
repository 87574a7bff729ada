"""The draft training step as scripts/bench_train.py times it: the trainer, its synthetic inputs, the timing.

`make_trainer` builds a DraftTrainer at any DraftConfig on its device (a random frozen embedding, the
draft vocabulary the first N target ids); `draft_step` gives one training step on synthetic inputs,
`whole` (the target's last hidden state through its final norm and full LM head, target_head.target_step,
then the draft's step, as training runs it) or the draft's step alone on handed-in draft-vocab logits;
`measure` times several (sequence length, step) pairs in one process, each after the memory fit check
(memory.py), one record each with the step's FLOP split (train_flops.py), the wall time of its first
step (compiles included) and this process's age when that step ended. One process for several lengths
pays the process start and the compiles once: a device call can hold the whole side-by-side table.
The JSON and the command line are the script's. Imports torch and the trainer's torch-only modules:
it runs on a bare GPU host, without pydantic.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import torch

from regen_service.bench.train_flops import step_figures
from regen_service.draft.config import DraftConfig
from regen_service.errors import LengthDoesNotFitError
from regen_service.train.lengths import compile_counts
from regen_service.train.memory import fit_check
from regen_service.train.target_head import target_step
from regen_service.train.trainer import DraftTrainer


def train_cfg(
    ttt: int, lr: float = 1e-4, attention: str = "auto", compile_dynamic="lengths", packing: bool = False
) -> SimpleNamespace:
    """TrainConfig's sections DraftTrainer reads, without pydantic (a bare GPU host may lack it)."""
    return SimpleNamespace(
        data=SimpleNamespace(seed=0, packing=packing),
        model=SimpleNamespace(attention=attention, draft_arch="llama", compile_dynamic=compile_dynamic),
        optimisation=SimpleNamespace(ttt_length=ttt, ttt_decay=0.8, lr=lr, betas=(0.9, 0.95), weight_decay=0.0,
                                     warmup_ratio=0.015, min_lr_ratio=0.1, grad_clip=0.5, bf16=True),
    )  # fmt: skip


def make_trainer(c: DraftConfig, ttt: int, ctx, lr=1e-4, steps=1000, attention="auto",
                 compile_dynamic="lengths", packing: bool = False) -> DraftTrainer:  # fmt: skip
    # made on the device: at Kimi-K2.5 shapes it is 1.2B entries, seconds of CPU before the GPU starts
    emb = torch.randn(c.vocab_size, c.hidden_size, device=ctx.device).mul_(0.02)
    tr = DraftTrainer(train_cfg(ttt, lr, attention, compile_dynamic, packing), c, emb, ctx, steps)
    d2t = torch.zeros(c.draft_vocab_size, dtype=torch.int64)  # draft ids = the first N target ids
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[: c.draft_vocab_size] = True
    tr.set_vocab(d2t, t2d)
    return tr


def sync() -> None:
    if torch.cuda.is_available():  # kernels run asynchronously: time them to their end
        torch.cuda.synchronize()


def timed(fn, n: int) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) / n


def target_side(c: DraftConfig, dev, dtype, soft: bool, generator=None):
    """(final-norm weight, frozen LM head [V, Ht], draft token ids or None): the target's side of a whole
    step. Rows past the draft vocabulary are zero, as bench_peers.py's SpecForge TargetHead: the argmax
    lies in the draft vocabulary, whose ids are the first N target ids (make_trainer)."""
    ht, n = c.target_hidden_size, c.draft_vocab_size
    norm_w = (torch.rand(ht, generator=generator, device=dev) + 0.5).to(dtype)
    head = torch.randn(c.vocab_size, ht, generator=generator, device=dev, dtype=dtype).mul_(0.02)
    head[n:] = 0
    return norm_w, head, torch.arange(n, device=dev) if soft else None


def draft_step(tr: DraftTrainer, c: DraftConfig, b: int, t: int, whole: bool, soft: bool):
    """The timed step on synthetic inputs. whole: as training runs it, the target's last hidden state
    (pre-norm) through its final norm and full LM head (argmax, draft columns; target_step) and then the
    draft's step, which takes the softmax; else the draft's step alone on given draft-vocab logits."""
    dev, bf, ht, n = tr.ctx.device, torch.bfloat16, c.target_hidden_size, c.draft_vocab_size
    aux = torch.randn(b, t, 3 * ht, device=dev, dtype=bf)
    ids = torch.randint(0, n, (b, t), device=dev)
    mask = torch.ones_like(ids)
    if not whole:
        dl = torch.randn(b, t, n, device=dev, dtype=bf) if soft else None
        return lambda: tr.train_batch(aux, ids, ids, mask, draft_logits=dl)
    last = torch.randn(b, t, ht, device=dev, dtype=bf)
    norm_w, head, draft_ids = target_side(c, dev, bf, soft)

    def step():
        pred, dl = target_step(last, norm_w, c.rms_norm_eps, head, draft_ids)
        return tr.train_batch(aux, ids, pred, mask, draft_logits=dl)

    return step


def measure(tr: DraftTrainer, c: DraftConfig, batch: int, pairs: list[tuple[int, str]], steps: int,
            soft: bool, base: dict, age=None, profile_dir=None) -> list[dict]:  # fmt: skip
    """One record per (seq, "whole"|"draft") in `pairs`, in order: warm-up (3 steps, the first timed on its
    own: it compiles; the fit check's time and compiles before it, apart) then `steps` timed steps, and with
    `profile_dir` 3 more of each whole step under torch.profiler (bench/profile.py: GPU time by kind of
    kernel and by op). A pair whose step cannot fit gives a record with `error` and `largest_fitting_seq`
    (the fit check's LengthDoesNotFitError) and the rest still run. `age()`: seconds since the process
    started, or None."""
    cuda = tr.ctx.device.type == "cuda"
    out = []
    for t, kind in pairs:
        rec = base | {"step": kind, "batch": batch, "seq": t}
        step = draft_step(tr, c, batch, t, kind == "whole", soft)
        try:  # before timing (the step's inputs and head already held)
            t0, cc0 = time.perf_counter(), compile_counts()
            fit_check(tr, t, batch, soft=soft, logits_dtype=torch.bfloat16, fields=("--seq", "--batch"))
            cc1 = compile_counts()
            rec["fit_check_s"] = round(time.perf_counter() - t0, 2)
            rec["fit_check_compiles"] = cc1.since(cc0).as_dict()
            first = timed(step, 1)
            rec["first_step_s"] = round(first, 3)
            rec["first_step_compiles"] = compile_counts().since(cc1).as_dict()
            rec["process_age_s"] = round(age(), 2) if age and age() is not None else None
            timed(step, 2)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            dt = timed(step, steps)
            if profile_dir is not None and cuda and kind == "whole":
                from regen_service.bench.profile import profile_steps

                name = f"prof-{base.get('shapes', 'x')}-{t}-{kind}.txt"
                rec["profile"] = profile_steps(step, 3, Path(profile_dir) / name)
        except LengthDoesNotFitError as e:
            out.append(rec | {"error": str(e), "largest_fitting_seq": e.largest_length})
            continue
        except torch.OutOfMemoryError as e:
            out.append(rec | {"oom": str(e)[:160]})
            continue
        finally:
            del step
            if cuda:
                torch.cuda.empty_cache()
        out.append(rec | {
            "step_s": round(dt, 4), "tokens_per_s": round(batch * t / dt),
            **step_figures(c, t, tr.ttt.ttt_length, batch, dt, whole=kind == "whole"),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            "draft_params_m": round(sum(p.numel() for p in tr.draft.parameters() if p.requires_grad) / 1e6, 1),
        })  # fmt: skip
    return out
