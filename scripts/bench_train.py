"""GPU benchmark of EAGLE-3 draft training; prints one JSON object per measurement.

Modes:
  draft   Llama-3.1-8B draft shapes (H 4096, 32/8 heads, I 14336, target vocab 128256, draft vocab 32000),
          sequence 2048, TTT 7, fed synthetic target states: tokens/s, model FLOPs utilization, peak memory.
          `--shapes kimi`: Kimi-K2.5's Llama-style draft as the trainer derives it (H 7168, 56 x 128 heads,
          I 18432, vocab 163840, draft vocab 32000); `--shapes kimi-mla`: its MLA draft (64 heads, q_lora
          1536, kv_lora 512, qk 128+64, v 128: the target's MLA dims); `--shapes tiny`: a CPU smoke test.
          `--step whole` (default) times the step as training runs it: the target's last hidden state
          (pre-norm) through its final norm and full LM head (argmax, draft-vocab columns;
          target_head.target_step), then the draft's step (softmax, TTT, backward, optimizer); FLOPs
          and MFU count the draft plus the target head (bench/train_flops.py). `--step draft` is the
          earlier figure: the draft's step alone, the target's draft-vocab logits handed in. `--seq` and
          `--step` take comma-separated lists: one process measures every (length, step) pair in turn
          (regen_service/bench/train_step.py), one JSON line each with its first step's wall time and
          the process's age when that step ended (start and compiles paid once).
  online  a random-weight ~1B Llama target (H 2048, 16 layers, vocab 128256) run online each step, with
          its draft: step time, the target's share of it.
  numerics  the fast step (flex attention on CUDA, fused head loss, bf16 parameters) against the reference
          (eager attention, per-step fp32 logits, fp32 parameters) on the same weights and batch: relative
          loss and worst gradient differences, hard and soft targets, T not a multiple of the 128 block.
  ddp     a learnable synthetic task (tokens walk a fixed permutation) for N steps, one process or under
          torchrun; each rank prints its losses; rank 0 alone writes the checkpoint.
  varlen  training speed over many sequence lengths (regen_service/bench/varlen.py): `--steps` (200)
          batches whose lengths follow a real run's (`--lengths-from DIR`, its output shards) or a built-in
          log-normal of answers with thinking (median 3,000, clipped to [200, 16384]), padded to
          `--length-bucket` (off | block | geometric): real and padded tokens/s with every recompile,
          the steady rate, compilations and compile seconds, time to first step, peak memory, the
          padded lengths met. `--packing`: the same samples packed in rows of `--max-length` as
          `data.packing` trains them (one shape). Runs on the CPU at `--shapes tiny` (give it a short
          `--max-length`).
Imports only torch/transformers and regen's torch-only modules (no pydantic, no Redis), so it runs on
a bare GPU host: PYTHONPATH=. python3 scripts/bench_train.py --mode draft --shapes kimi --seq 8192
"""

from __future__ import annotations

import argparse
import json
import os
import time
from types import SimpleNamespace

import torch

from regen_service.bench import train_step, varlen
from regen_service.bench.train_flops import PEAK_BF16, draft_shapes, model_flops
from regen_service.bench.train_step import make_trainer, timed, train_cfg
from regen_service.draft.checkpoint import save_checkpoint
from regen_service.draft.config import DraftConfig
from regen_service.train.compiled import COMPILE_DYNAMIC
from regen_service.train.dist import init_distributed, shutdown
from regen_service.train.trainer import AUTO_ORDER

__all__ = ["draft_shapes", "init_distributed", "make_trainer", "model_flops", "timed"]  # regen_shapes.py's


def flat_cfg(cfg: SimpleNamespace) -> dict:
    """The flat keys a checkpoint's train_config holds (TrainConfig.flat_dict's form)."""
    return {k: v for section in vars(cfg).values() for k, v in vars(section).items()}


def kimi_shapes(mla: bool) -> DraftConfig:
    yarn = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
    common = dict(hidden_size=7168, intermediate_size=18432, rms_norm_eps=1e-5, rope_theta=50000.0,
                  max_position_embeddings=262144, vocab_size=163840, draft_vocab_size=32000,
                  target_hidden_size=7168, rope_scaling=yarn)  # fmt: skip
    if not mla:
        return DraftConfig(num_attention_heads=56, num_key_value_heads=56, head_dim=128, **common)
    return DraftConfig(num_attention_heads=64, num_key_value_heads=64, head_dim=192, draft_arch="mla", q_lora_rank=1536,
                       kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, **common)  # fmt: skip


SHAPES = {
    "llama-3.1-8b": lambda: draft_shapes(4096, 32, 8, 14336, 128256, 32000),
    "kimi": lambda: kimi_shapes(False),
    "kimi-mla": lambda: kimi_shapes(True),
    "tiny": lambda: draft_shapes(256, 4, 2, 512, 4096, 1024),  # the CPU smoke test's
}


def bench_draft(a) -> list[dict]:
    started = varlen.process_age_s()
    ctx = init_distributed(None)  # CUDA where there is one; the CPU runs the tiny shapes' smoke test
    c = SHAPES[a.shapes]()
    tr = make_trainer(c, a.ttt, ctx, attention=a.attention, compile_dynamic=a.compile_dynamic)
    base = {"mode": "draft", "shapes": a.shapes, "target": a.target, "attention": a.attention, "ttt": a.ttt,
            "attention_impl": tr.draft.midlayer.self_attn.impl, "compile_dynamic": a.compile_dynamic, "imported_age_s": started, "built_age_s": varlen.process_age_s()}  # fmt: skip
    pairs = [(int(t), kind) for t in str(a.seq).split(",") for kind in a.step.split(",")]
    recs = train_step.measure(tr, c, a.batch, pairs, a.steps, a.target == "soft", base, varlen.process_age_s,
                              a.profile)  # fmt: skip
    if any("largest_fitting_seq" in r for r in recs):  # printed by main; the exit status says it
        for r in recs:
            print(json.dumps(r), flush=True)
        raise SystemExit(2)
    return recs


def bench_online(a) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from regen_service.train.target import HFTarget

    ctx = init_distributed("cuda")
    tc = LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131072, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("cuda"):
        model = LlamaForCausalLM(tc).to(torch.bfloat16)
    target = HFTarget("<random>", "cuda", model=model)
    nparams = sum(p.numel() for p in model.parameters())
    c = draft_shapes(2048, 32, 8, 8192, 128256, 32000)
    tr = make_trainer(c, a.ttt, ctx)
    b, t = a.batch, a.seq
    ids = torch.randint(0, 32000, (b, t), device="cuda")
    mask = torch.ones_like(ids)

    def step():
        aux, tgt = target(ids)
        tr.train_batch(aux, ids, tgt, mask)

    timed(step, 2)
    torch.cuda.reset_peak_memory_stats()
    total = timed(step, a.steps)
    tgt_s = timed(lambda: target(ids), a.steps)
    return {
        "mode": "online", "target_params_b": round(nparams / 1e9, 3), "aux_layer_ids": target.aux_layer_ids,
        "batch": b, "seq": t, "ttt": a.ttt, "step_s": round(total, 4), "target_fwd_s": round(tgt_s, 4),
        "target_share": round(tgt_s / total, 3), "tokens_per_s": round(b * t / total),
        "draft_mfu_vs_989": round(model_flops(c, t, a.ttt) * b / (total - tgt_s) / PEAK_BF16, 4),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }  # fmt: skip


def _numerics_case(
    t: int, dtype: torch.dtype, soft: bool, dev: str, mla: bool = False, impl: str = "flex"
) -> dict:
    import copy

    from regen_service.train.grads import GradBuffer
    from regen_service.train.model import Eagle3Draft
    from regen_service.train.ttt import ttt_loss

    torch.manual_seed(0)
    c = DraftConfig(512, 1024, 8, 2, 64, 1e-5, 500000.0, 4096, 3000, 700, 512)
    if mla:  # the MLA draft at Kimi's proportions, scaled down (qk 128+64 = 192 and v 128, as Kimi's)
        c = DraftConfig(512, 1024, 8, 8, 192, 1e-5, 50000.0, 4096, 3000, 700, 512, draft_arch="mla",
                        q_lora_rank=384, kv_lora_rank=128, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                      "mscale": 1.0, "mscale_all_dim": 1.0})  # fmt: skip
    ref = Eagle3Draft(c).to(dev)
    t2d = torch.zeros(3000, dtype=torch.bool)
    t2d[:700] = True
    ref.set_vocab(torch.zeros(700, dtype=torch.long), t2d)
    new = copy.deepcopy(ref).to(dtype)
    new.set_attention(impl if dev == "cuda" else "eager")
    buf = GradBuffer(list(new.parameters()))  # the gradients as training makes them (grads.py, linear.py)
    aux, ids = torch.randn(2, t, 1536, device=dev), torch.randint(0, 900, (2, t), device=dev)
    mask = (torch.rand(2, t, device=dev) > 0.2).long()
    probs = torch.softmax(torch.randn(2, t, 700, device=dev) * 3, -1) if soft else None
    l0, _ = ttt_loss(ref, aux, ids, ids, mask, 7, 0.8, probs, fused=False)
    l0.backward()
    buf.begin()
    l1, _ = ttt_loss(new, aux.to(dtype), ids, ids, mask, 7, 0.8, None if probs is None else probs.to(dtype))
    l1.backward()
    buf.finish()
    g = {
        n: float((p1.main_grad - p0.grad).norm() / p0.grad.norm())
        for (n, p0), (_, p1) in zip(ref.named_parameters(), new.named_parameters(), strict=True)
        if p0.grad is not None
    }
    return {
        "seq": t, "dtype": str(dtype), "target": "soft" if soft else "hard", "attention": new.midlayer.self_attn.impl,
        "draft_arch": c.draft_arch,
        "loss_rel": abs(float(l1) - float(l0)) / abs(float(l0)), "grad_rel_max": max(g.values()),
        "grad_rel_worst": max(g, key=g.get),
    }  # fmt: skip


def bench_numerics(a) -> dict:
    """--attention auto: flex (fp32 and bf16) and flash; fa4 | flash | cudnn | flex: that path's bf16 cases
    alone."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if a.attention in ("fa4", "flash", "cudnn", "flex"):
        # cuDNN and FlashAttention-4 here: qk head dim <= 128, so the Llama-style draft alone
        mla = (False, True) if a.attention not in ("cudnn", "fa4") else (False,)
        out = [_numerics_case(t, torch.bfloat16, soft, dev, m, a.attention)
               for m in mla for t, soft in ((256, True), (300, False))]  # fmt: skip
        return {"mode": "numerics", "cases": out}
    cases = [(300, torch.float32, False), (300, torch.float32, True), (256, torch.bfloat16, True)]
    cases += [(300, torch.bfloat16, False)]
    out = [_numerics_case(t, dt, soft, dev) for t, dt, soft in cases]
    # the MLA draft in bf16 only: flex in fp32 at qk head dim 192 exceeds shared memory (flexattn.fits)
    out += [_numerics_case(t, torch.bfloat16, soft, dev, mla=True) for t, soft in ((256, True), (300, False))]
    if dev == "cuda":  # flash (FlashAttention-2 + the diagonal merge) takes bf16 only
        out += [_numerics_case(t, torch.bfloat16, soft, dev, mla, "flash")
                for t, soft, mla in ((256, True, False), (300, False, False), (256, True, True), (300, False, True))]  # fmt: skip
    return {"mode": "numerics", "cases": out}


def bench_ddp(a) -> dict:
    ctx = init_distributed(None)
    c = draft_shapes(1024, 16, 4, 4096, 32000, 4096)
    tr = make_trainer(c, a.ttt, ctx, lr=1e-3, steps=a.steps)
    perm = torch.randperm(4096, generator=torch.Generator().manual_seed(0))
    emb = torch.randn(4096, 3 * 1024, generator=torch.Generator().manual_seed(1)).to(
        ctx.device, torch.bfloat16
    )
    gen = torch.Generator().manual_seed(1000 + ctx.rank)  # each rank its own data
    losses, t0 = [], time.perf_counter()
    for _ in range(a.steps):
        x = torch.empty(a.batch, a.seq, dtype=torch.int64)
        x[:, 0] = torch.randint(0, 4096, (a.batch,), generator=gen)
        for j in range(1, a.seq):
            x[:, j] = perm[x[:, j - 1]]
        x = x.to(ctx.device)
        m = tr.train_batch(emb[x], x, perm.to(ctx.device)[x], torch.ones_like(x))
        losses.append(round(float(m["loss_0"]), 4))
    elapsed = time.perf_counter() - t0
    if ctx.is_main:
        state = tr.state() | {
            "aux_layer_ids": [2, 8, 13], "target_num_layers": 16, "train_config": flat_cfg(train_cfg(a.ttt)),
            "consumed_shards": [], "in_progress": None,
        }  # fmt: skip
        save_checkpoint(a.out, state)
    shutdown(ctx)
    return {
        "mode": "ddp", "rank": ctx.rank, "world": ctx.world, "steps": a.steps, "s": round(elapsed, 2),
        "loss0_every_10": [*losses[::10], losses[-1]], "wrote_checkpoint": ctx.is_main,
    }  # fmt: skip


def bench_varlen(a) -> dict:
    ctx = init_distributed("cuda" if torch.cuda.is_available() else "cpu")
    c = SHAPES[a.shapes]()
    n = a.steps * a.batch  # packed: these samples, in as many packed steps as they fill
    pool = varlen.shard_lengths(a.lengths_from) if a.lengths_from else varlen.builtin_lengths(n)
    lengths = varlen.draw(pool, n, 0, a.max_length) if a.lengths_from else pool
    tr = make_trainer(c, a.ttt, ctx, steps=a.steps, attention=a.attention, compile_dynamic=a.compile_dynamic,
                      packing=a.packing)  # fmt: skip
    built = varlen.process_age_s()
    res = varlen.run_varlen(
        tr,
        lengths,
        a.batch,
        a.length_bucket,
        a.max_length,
        a.target == "soft",
        built,
        a.step == "whole",
        packed=a.packing,
    )
    source = a.lengths_from or varlen.BUILTIN_NAME
    return {
        "mode": "varlen",
        "shapes": a.shapes,
        "target": a.target,
        "ttt": a.ttt,
        "lengths_from": source,
        "compile_dynamic": a.compile_dynamic,
        **res,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("draft", "online", "ddp", "numerics", "varlen"), default="draft")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", default="2048", help="draft: comma-separated lengths, measured in one process")
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--steps", type=int, default=None, help="default 10; varlen 200")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench"),
                   help="ddp: the folder rank 0 writes its checkpoint to (results go to stdout)")  # fmt: skip
    p.add_argument("--target", choices=("soft", "hard"), default="soft")
    p.add_argument("--attention", choices=("auto", *AUTO_ORDER), default="auto")
    p.add_argument("--shapes", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--step", default="whole", help="whole | draft (draft mode: comma-separated, each length)")
    p.add_argument("--lengths-from", default=None, help="varlen: a run's outputs folder (shard-*.parquet)")
    p.add_argument("--length-bucket", choices=("off", "block", "geometric"), default="geometric")
    p.add_argument("--max-length", type=int, default=16384, help="varlen: sequences cut here")
    p.add_argument(
        "--packing", action="store_true", help="varlen: the samples packed in rows of --max-length"
    )
    p.add_argument(
        "--compile-dynamic",
        choices=COMPILE_DYNAMIC,
        default="lengths",
        help="how the hot functions compile (regen_service/train/compiled.py)",
    )
    p.add_argument(
        "--profile", default=None, help="draft: a folder; 3 more whole steps per length under torch.profiler"
    )
    a = p.parse_args()
    if a.mode != "draft":
        a.seq = int(a.seq)
    if any(k not in ("whole", "draft") for k in a.step.split(",")) or (a.mode != "draft" and "," in a.step):
        p.error(f"--step {a.step}: allowed whole, draft (a comma-separated list in --mode draft)")
    a.steps = a.steps if a.steps is not None else (200 if a.mode == "varlen" else 10)
    modes = {"draft": bench_draft, "online": bench_online, "ddp": bench_ddp, "numerics": bench_numerics}
    modes["varlen"] = bench_varlen
    res = modes[a.mode](a)
    gpu = {"gpu": torch.cuda.get_device_name()} if torch.cuda.is_available() else {}
    for r in res if isinstance(res, list) else [res]:
        print(json.dumps(r | gpu), flush=True)


if __name__ == "__main__":
    main()
