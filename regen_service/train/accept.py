"""A small speculative-decoding check on the CPU: the accept length a draft reaches with its target.

Chain drafting with topk 1: after each target forward the draft proposes k tokens greedily from the
target's aux hidden states (step 0 over the whole prefix, then k-1 steps each on its own previous
hidden, attending to the prefix plus its own earlier steps, exactly as trained); the target verifies
greedily. Accept length = tokens produced per verify forward, bonus token included (1.0 = nothing
accepted), the number SGLang reports as spec_accept_length. No KV cache: every step recomputes the
prefix, which is fine at test sizes. Serving-side measurement with SGLang is left to others.
"""

from __future__ import annotations

import torch

from regen_service.train.model import Eagle3Draft
from regen_service.train.target import HFTarget


@torch.no_grad()
def propose(draft: Eagle3Draft, aux: torch.Tensor, seq: torch.Tensor, next_token: int, k: int) -> list[int]:
    """k draft tokens after seq + [next_token]. aux: [1, len(seq), 3H] for seq."""
    ids = torch.cat([seq[1:], torch.tensor([next_token])])[None]  # position t reads token t+1
    t = ids.shape[1]
    hidden = draft.fc(aux.to(draft.fc.weight.dtype))
    cache: list = []
    out: list[int] = []
    positions = torch.arange(t)[None]
    for j in range(k):
        hidden, logits = draft.step(ids, hidden, positions, cache)
        tok = int(draft.draft_to_target(logits[0, -1].argmax()))
        out.append(tok)
        # the next step runs only at the last position; its cache[0] is the full step-0 prefix
        cache = [cache[0], *[(kk[:, :, -1:], vv[:, :, -1:]) for kk, vv in cache[1:]]] if j else [cache[0]]
        hidden, ids, positions = hidden[:, -1:], torch.tensor([[tok]]), torch.tensor([[t + j]])
    return out


@torch.no_grad()
def accept_length(
    target: HFTarget, draft: Eagle3Draft, prompts: list[list[int]], k: int = 3, max_new_tokens: int = 32
) -> dict:
    """Greedy speculative decoding of each prompt; returns mean accept length and counts."""
    draft = draft.eval().to("cpu")
    tokens = steps = 0
    for prompt in prompts:
        seq = torch.tensor(prompt, dtype=torch.int64)
        aux, pred = target(seq[None])
        nxt, made = int(pred[0, -1]), 0
        while made < max_new_tokens:
            guess = propose(draft, aux.cpu().float(), seq, nxt, k)
            full = torch.cat([seq, torch.tensor([nxt, *guess])])
            aux_full, pred = target(full[None])
            verify = pred[0, len(seq) : len(seq) + k + 1].tolist()  # target's token after nxt, d1, ...
            a = 0
            while a < k and guess[a] == verify[a]:
                a += 1
            seq = torch.cat([seq, torch.tensor([nxt, *guess[:a]])])
            nxt = verify[a]  # the bonus token
            aux = aux_full[:, : len(seq)]
            tokens += a + 1
            made += a + 1
            steps += 1
    return {"accept_length": tokens / max(1, steps), "verify_steps": steps, "tokens": tokens, "k": k}
