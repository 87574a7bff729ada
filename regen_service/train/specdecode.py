"""Real speculative decoding, batched: the accept length a draft gets against its target on prompts.

Chain drafting (topk 1) with greedy verification, as accept.py does one prompt at a time, for a batch
of prompts at once: after each target forward the draft proposes k tokens from the target's aux
hidden states, and one target forward over [prefix, bonus token, k draft tokens] verifies them all;
the row keeps the longest prefix of draft tokens equal to the target's own greedy tokens, plus the
target's next token (the bonus). Accept length = tokens produced per verify forward, bonus included
(1.0 = nothing accepted), SGLang's spec_accept_length. Rows are right-padded; the draft runs in the
training layout (ttt.unroll's alignment: step j at position t reads token x[t+1+j]) over the whole
padded width, and each row's proposal is read at its own last position, where causality keeps the
padding out of it. A row ends at its stop token or after `max_new_tokens`. No KV cache: every verify
recomputes the prefix (small targets). Returns figures overall and per source, and the greedy
continuations (the target's own text: evaluate.py's simulated accept length is exact on them).
"""

from __future__ import annotations

import torch

from regen_service.train.model import Eagle3Draft
from regen_service.train.ttt import _shift


def _pad(rows: list[list[int]], width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
        mask[i, : len(r)] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def propose(
    draft: Eagle3Draft, aux: torch.Tensor, seqs: list[list[int]], nxt: list[int], k: int
) -> list[list[int]]:
    """k greedy draft tokens per row after seq + [nxt]; aux [B, >=max len, 3H] covers each seq."""
    dev = draft.fc.weight.device
    lens = [len(s) for s in seqs]
    t = max(lens) + k + 1
    x, _ = _pad([[*s, n] for s, n in zip(seqs, nxt, strict=True)], t, dev)
    a = torch.zeros(len(seqs), t, aux.shape[-1], dtype=draft.fc.weight.dtype, device=dev)
    w = min(t, aux.shape[1])
    a[:, :w] = aux[:, :w].to(dev, a.dtype)
    hidden = draft.fc(a)
    cos, sin = draft.rotary.get(t + k, dev, hidden.dtype)
    last = torch.tensor([n - 1 for n in lens], device=dev)
    rows = torch.arange(len(seqs), device=dev)
    cache: list = []
    out = []
    for j in range(k):
        hidden = draft.step_hidden(
            _shift(x, 1 + j), hidden, cos[None, None, j : j + t], sin[None, None, j : j + t], cache
        )
        logits = draft.lm_head(draft.norm(hidden[rows, last]))
        tok = draft.draft_to_target(logits.argmax(-1))
        x[rows, last + 2 + j] = tok
        out.append(tok)
    return torch.stack(out, 1).tolist()


@torch.no_grad()
def decode_batch(target, draft, prompts: list[list[int]], k: int, max_new_tokens: int, stop_id: int | None):
    """-> per row (tokens produced, verify steps, generated ids)."""
    dev = draft.fc.weight.device
    seqs = [list(p) for p in prompts]
    ids, mask = _pad(seqs, max(map(len, seqs)), dev)
    aux, pred, _ = target.states(ids, mask)
    nxt = [int(pred[i, len(s) - 1]) for i, s in enumerate(seqs)]
    made = [0] * len(seqs)
    steps = [0] * len(seqs)
    gen: list[list[int]] = [[] for _ in seqs]
    live = list(range(len(seqs)))
    while live:
        sub = [seqs[i] for i in live]
        guess = propose(draft, aux, sub, [nxt[i] for i in live], k)
        full = [[*s, nxt[i], *g] for s, i, g in zip(sub, live, guess, strict=True)]
        ids, mask = _pad(full, max(map(len, full)), dev)
        aux_f, pred, _ = target.states(ids, mask)
        keep, keep_rows = [], []
        for r, i in enumerate(live):
            n = len(seqs[i])
            verify = pred[r, n : n + k + 1].tolist()
            a = 0
            while a < k and guess[r][a] == verify[a]:
                a += 1
            new = [nxt[i], *guess[r][:a]]
            if stop_id is not None and stop_id in new:
                new = new[: new.index(stop_id) + 1]
            new = new[: max_new_tokens - made[i]]
            seqs[i] += new
            gen[i] += new
            made[i] += len(new)
            steps[i] += 1
            nxt[i] = verify[a]
            if made[i] < max_new_tokens and not (stop_id is not None and new and new[-1] == stop_id):
                keep.append(i)
                keep_rows.append(r)
        live = keep
        aux = aux_f[keep_rows] if keep_rows else aux_f
    return [(m, s, g) for m, s, g in zip(made, steps, gen, strict=True)]


@torch.no_grad()
def accept_lengths(
    target, draft: Eagle3Draft, prompts: list[list[int]], sources: list[str], k: int,
    max_new_tokens: int = 96, stop_id: int | None = None, batch_size: int = 64,
) -> dict:  # fmt: skip
    """Greedy speculative decoding of every prompt: accept length overall and per source."""
    was = draft.training
    draft.eval()
    impl = draft.midlayer.self_attn.impl
    draft.set_attention("eager")  # the padded width changes every verify: no compiled kernel per shape
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    res: list = [None] * len(prompts)
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        for i, r in zip(
            idx,
            decode_batch(target, draft, [prompts[i] for i in idx], k, max_new_tokens, stop_id),
            strict=True,
        ):
            res[i] = r
    draft.set_attention(impl)
    draft.train(was)
    per: dict[str, list[int]] = {}
    for src, (m, s, _) in zip(sources, res, strict=True):
        t = per.setdefault(src, [0, 0])
        t[0] += m
        t[1] += s
    tok, st = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
    return {
        "k": k, "accept_length": round(tok / max(1, st), 4), "tokens": tok, "verify_steps": st,
        "sources": {s: round(v[0] / max(1, v[1]), 4) for s, v in sorted(per.items())},
        "generated": [r[2] for r in res],
    }  # fmt: skip
