"""Held-out evaluation of the draft: validation loss, per-step accuracy and simulated accept length.

Each held-out sample (eval_set.py) goes through the same target backend as training (hf or vllm:
`target.example_states`), and the draft is unrolled over it exactly as training-time test runs it (ttt.unroll):
step j at position t reads token x[t+1+j] and the draft's own hidden from step j-1. Per step j and
position t, on the positions whose predicted token x[t+2+j] is an answer token:
- `loss_j`: the training objective's cross-entropy (soft: against the target's distribution over the
  draft vocabulary; hard: its argmax), on the positions training counts (target argmax in the draft
  vocabulary); `loss` weighs them by ttt_decay**j as training does;
- `acc_j`: the draft's argmax (mapped to a target id) equals the target's argmax at t+1+j, the token
  greedy verification accepts (a target token outside the draft vocabulary is a miss, as in serving);
- accept length at k draft tokens: a position's chain accepts j tokens when steps 0..j-1 all match;
  accept length = 1 + mean(min(accepted, k)) over positions whose k steps lie inside the answer, the
  number SGLang reports as spec_accept_length for a chain of k (topk 1), averaged over every answer
  position. Real decoding does not visit every position: `accept_length_walk` follows it (a verify at
  t, then the next at t + accepted + 1) and is exact for a greedy decode of the answer when the answer
  is the target's own greedy text (temperature 0 data: then x[t+1+j] is the token the accepted chain
  fed); the all-position mean reads higher (measured on a 42M code target: 3.46 against 2.83 real at
  k=5, docs/quality.md). Over sampled answers both are estimates. Unlike
  SpecForge's simulated_acc_len (a product of per-step accuracies, specforge/eval/evaluator.py), it
  counts each position's actual chain, so correlated misses are not treated as independent.
Counts are summed over the eval set before any ratio (as SpecForge's evaluator does, so the figures do
not depend on the batch size) and, under torchrun, over ranks: every rank scores its stride share of
the same eval set and the count table is all-reduced (one collective of a fixed shape). The target's
mean next-token entropy over the draft vocabulary is reported too (a flat target teaches soft targets
nothing). Deciding when to evaluate and what to do with the result is loop.py's.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from regen_service.train.dist import DistContext
from regen_service.train.eval_set import EvalSample
from regen_service.train.lengths import bucketer
from regen_service.train.model import Eagle3Draft
from regen_service.train.ttt import _shift, unroll


def _shift_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, t+k] for a [B, T, N] tensor, zero past the end."""
    out = torch.zeros_like(x)
    if k < x.shape[1]:
        out[:, : x.shape[1] - k] = x[:, k:]
    return out


@torch.no_grad()
def chain_stats(draft: Eagle3Draft, aux, input_ids, target_ids, loss_mask, steps: int, target_probs=None):
    """Per TTT step j (dim 0) and position: `answer` (x[t+2+j] is an answer token), `correct` (the draft's
    token is the target's), `ce` and `counted` (the training loss's positions); `lead` [B, T]: leading
    correct steps of each position's chain."""
    answer, correct, ce, counted = [], [], [], []
    for j, hidden in enumerate(unroll(draft, aux, input_ids, steps)):
        logp = torch.log_softmax(draft.lm_head(draft.norm(hidden)).float(), -1)
        want = _shift(target_ids, 1 + j)
        in_ans = _shift(loss_mask, 2 + j).bool()
        tgt_d = draft.t2d_index[want]
        answer.append(in_ans)
        correct.append(in_ans & (draft.draft_to_target(logp.argmax(-1)) == want))
        counted.append(in_ans & (tgt_d >= 0))
        if target_probs is not None:
            ce.append(-(_shift_rows(target_probs, 1 + j) * logp).sum(-1))
        else:
            ce.append(-logp.gather(-1, tgt_d.clamp(min=0)[..., None]).squeeze(-1))
    correct_t = torch.stack(correct)
    lead = correct_t.long().cumprod(0).sum(0)
    return {
        "answer": torch.stack(answer),
        "correct": correct_t,
        "ce": torch.stack(ce),
        "counted": torch.stack(counted),
        "lead": lead,
    }


def _fields(k: int) -> int:
    # samples, then per step: answer positions, correct, ce sum, ce count, chain positions, chain accepted;
    # then entropy sum, entropy count, positions whose target token is outside the draft vocabulary;
    # then per k: tokens and verify steps of the decoding walk (_walks)
    return 1 + 6 * k + 3 + 2 * k


def _walks(lead: torch.Tensor, mask: torch.Tensor, k_max: int) -> list[torch.Tensor]:
    """Per k = 1..k_max: (tokens, verify steps) per row of chain decoding read off the per-position leads:
    a verify at position t (the bonus token x[t+1] is an answer token) accepts a = min(lead[t], k) draft
    tokens and produces a + 1 tokens, and the next verify is at t + a + 1. This is what real greedy
    decoding does on the target's own greedy text; the mean over all positions (`accept_length`) weighs
    the easy stretches that decoding crosses in few verifies as much as the hard ones, and reads higher."""
    b, t = mask.shape
    out = torch.zeros(2 * k_max, b, dtype=torch.float64)
    m = mask.tolist()
    ld = lead.tolist()
    for r in range(b):
        for k in range(1, k_max + 1):
            pos = tokens = steps = 0
            while pos < t - 1:
                if not m[r][pos + 1]:
                    pos += 1
                    continue
                a = min(ld[r][pos], k)
                end = pos + 1
                while end < t and m[r][end]:
                    end += 1
                tokens += min(a + 1, end - pos - 1)
                steps += 1
                pos += a + 1
            out[2 * (k - 1), r], out[2 * (k - 1) + 1, r] = tokens, steps
    return list(out)


@torch.no_grad()
def evaluate(draft: Eagle3Draft, target, samples: list[EvalSample], cfg, ctx: DistContext) -> dict:
    """Score the draft on `samples` (the same list on every rank). Returns the results table (results())."""
    k = cfg.optimisation.ttt_length
    sources = sorted({s.source for s in samples})
    acc = torch.zeros(len(sources), _fields(k), dtype=torch.float64)
    index = {s: i for i, s in enumerate(sources)}
    n_draft = draft.config.draft_vocab_size
    draft_ids = draft.draft_to_target(torch.arange(n_draft, device=draft.d2t.device))
    mine = samples[ctx.rank :: ctx.world]
    was_training = draft.training
    draft.eval()
    # padded to length buckets as training is (lengths.py): pads carry no answer token, so no count moves
    pad_to = bucketer(cfg.data.length_bucket, cfg.evaluation.eval_max_length)
    for b in range(0, len(mine), cfg.data.batch_size):
        chunk = mine[b : b + cfg.data.batch_size]
        # samples with images are scored on the engine's expanded sequence, as they train (vl_samples.py)
        batch, aux, tgt, logits = target.example_states(chunk, draft_ids, pad_to)
        dev = draft.fc.weight.device
        ids, mask, tgt = batch["input_ids"].to(dev), batch["loss_mask"].to(dev), tgt.to(dev)
        probs = torch.softmax(logits.to(dev).float(), -1)
        st = chain_stats(
            draft, aux.to(dev), ids, tgt, mask, k, probs if cfg.optimisation.target == "soft" else None
        )
        rows = []
        for j in range(k):
            chain = st["answer"][: j + 1].all(0)  # the k = j+1 chain lies inside the answer
            rows += [
                st["answer"][j].sum(1),
                st["correct"][j].sum(1),
                (st["ce"][j] * st["counted"][j]).sum(1),
                st["counted"][j].sum(1),
                chain.sum(1),
                (st["lead"].clamp(max=j + 1) * chain).sum(1),
            ]
        nxt = _shift(mask, 1).bool()  # positions whose next token is an answer token
        ent = -(probs * torch.log(probs.clamp(min=1e-30))).sum(-1)
        oov = st["answer"][0] & (draft.t2d_index[_shift(tgt, 1)] < 0)
        rows += [(ent * nxt).sum(1), nxt.sum(1), oov.sum(1)]
        rows += _walks(st["lead"].cpu(), mask.cpu(), k)
        per_row = torch.stack([r.double().cpu() for r in rows], 1)  # [B, F-1]
        src = torch.tensor([index[s.source] for s in chunk])
        acc[:, 0].index_add_(0, src, torch.ones(len(chunk), dtype=torch.float64))
        acc[:, 1:].index_add_(0, src, per_row)
    draft.train(was_training)
    if ctx.distributed:
        t = acc.to(ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        acc = t.cpu()
    out = results(acc.sum(0), k, cfg.optimisation.ttt_decay, n_draft)
    out["sources"] = {s: results(acc[i], k, cfg.optimisation.ttt_decay, n_draft) for s, i in index.items()}
    return out


def results(v: torch.Tensor, k: int, decay: float, n_draft: int) -> dict:
    """One row of the count table -> figures (ratios over summed counts)."""
    v = v.tolist()
    per = [v[1 + 6 * j : 7 + 6 * j] for j in range(k)]
    ent_sum, ent_n, oov = v[1 + 6 * k : 4 + 6 * k]
    walk = v[4 + 6 * k :]

    def ratio(a, b):
        return round(a / b, 5) if b else None

    losses = [ratio(p[2], p[3]) for p in per]
    return {
        "samples": int(v[0]),
        "positions": int(per[0][0]) if per else 0,
        "loss": round(sum(decay**j * (x or 0.0) for j, x in enumerate(losses)), 5),
        "loss_per_step": losses,
        "acc": [ratio(p[1], p[0]) for p in per],
        # key: number of draft tokens k (a string, as JSON and TensorBoard tags need)
        "accept_length": {
            str(j + 1): (round(1 + p[5] / p[4], 4) if p[4] else None) for j, p in enumerate(per)
        },
        # tokens per verify of the decoding walk (_walks): exact for greedy decoding of greedy answers
        "accept_length_walk": {
            str(j + 1): (round(walk[2 * j] / walk[2 * j + 1], 4) if walk[2 * j + 1] else None)
            for j in range(k)
        },
        "target_entropy": ratio(ent_sum, ent_n),
        "ln_draft_vocab": round(math.log(n_draft), 5),
        "oov_share": ratio(oov, per[0][0]) if per else None,
    }


def accept_at(res: dict, k: int) -> float | None:
    """The accept length at k draft tokens (capped at the TTT length)."""
    al = res["accept_length"]
    return al.get(str(min(k, len(al))))


def format_table(res: dict, best: dict | None = None) -> str:
    """The eval table a person reads: per source (and all), loss, per-step accuracy, accept length per k."""
    k = len(res["acc"])

    def f(x, w=6, d=3):
        return f"{x:{w}.{d}f}" if x is not None else " " * (w - 1) + "-"

    head = f"{'source':<18} {'samples':>7} {'loss':>6} " + " ".join(f"{'acc' + str(j):>6}" for j in range(k))
    head += "  " + " ".join(f"{'al@' + str(j + 1):>6}" for j in range(k))
    lines = [
        f"held-out eval at step {res.get('step', '?')}: accept length al@k = tokens per verify with k draft "
        f"tokens; target entropy {f(res['target_entropy'], 0, 2).strip()} nats of ln(draft vocab) "
        f"{res['ln_draft_vocab']:.2f}",
        head,
    ]
    rows = [("all", res), *sorted(res.get("sources", {}).items())]
    for name, r in rows:
        accs = " ".join(f(a) for a in r["acc"])
        als = " ".join(f(r["accept_length"][str(j + 1)]) for j in range(k))
        lines.append(f"{name[:18]:<18} {r['samples']:>7} {f(r['loss'])} {accs}  {als}")
    if best:
        lines.append(f"best: step {best['step']} ({best['checkpoint']}), accept length {best['accept_length']:.3f} "
                     f"at k={best['k']}")  # fmt: skip
    return "\n".join(lines)
