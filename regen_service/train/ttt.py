"""Training-time test (TTT): the EAGLE-3 loss, unrolled over `ttt_length` draft steps.

Alignment (SpecForge's): at step i the draft sits at position t with position id t + i, reads the
embedding of token x[t+1+i], and learns the target's prediction at position t+1+i (the target's
next token after x[t+1+i]): its distribution over the draft vocabulary (soft, `target_probs`
[B, T, N], the EAGLE-3 objective) or its argmax (hard, when no probs are given). Step 0's hidden
input is fc(aux hidden states of position t); step i > 0 feeds the draft's own output hidden of
step i-1 and attends to the step-0 prefix plus its own earlier steps at the same position (the
per-step k/v cache in model.Attention). A position counts only when the predicted token is an
assistant token (loss_mask of x[t+2+i]) and the target's argmax is in the draft vocabulary (t2d).
Packed rows (`docs`, packing.py): positions restart at each document, attention stays inside it, and a
position whose step reads past its document's end (t+2+i in the next one) counts in no loss.
Step losses are weighted decay**i (0.8 by default), each a mean over its counted positions.
The head and loss run once over all steps' rows (loss.head_loss, fused; `fused=False` is the
reference: per-step fp32 logits through plain autograd). Imports torch only.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from regen_service.train.flash_ttt import TTTCache
from regen_service.train.linear import linear
from regen_service.train.loss import head_loss, reference_loss
from regen_service.train.model import Eagle3Draft
from regen_service.train.packing import Documents


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, t+k], zero past the end."""
    if k >= x.shape[1]:
        return torch.zeros_like(x)
    return torch.cat([x[:, k:], x.new_zeros(x.shape[0], k)], 1)


def unroll(
    draft: Eagle3Draft,
    aux: torch.Tensor,
    input_ids: torch.Tensor,
    steps: int,
    docs: Documents | None = None,
    doc_ids: torch.Tensor | None = None,
) -> Iterator[torch.Tensor]:
    """The draft's output hidden [B, T, H] of each TTT step in turn: step i at position t (position id
    t + i) reads token x[t+1+i] and step i-1's hidden (step 0: fc(aux)). The training loss and the
    held-out evaluation (evaluate.py) both unroll through here, so they score the same computation.
    docs: a packed batch's documents (position ids restart at each; attention stays inside each),
    doc_ids its `doc_ids` on the device when the caller has them already."""
    t = input_ids.shape[1]
    hidden = linear(aux.to(draft.fc.weight.dtype), draft.fc.weight)
    cache = TTTCache()  # its KeyGrads sum each diagonal key's gradient across the steps that read it
    cos, sin = draft.rotary.get(t + steps, input_ids.device, hidden.dtype)
    if docs is None:
        tables = [(cos[None, None, i : i + t], sin[None, None, i : i + t]) for i in range(steps)]
    else:
        cache.segments = docs.segments
        cache.doc_ids = docs.doc_ids(input_ids.device) if doc_ids is None else doc_ids
        pos = docs.positions(input_ids.device)  # [B, T]: the tables indexed per token, [B, 1, T, d]
        tables = [(cos[pos + i][:, None], sin[pos + i][:, None]) for i in range(steps)]
    for i in range(steps):
        hidden = draft.step_hidden(_shift(input_ids, 1 + i), hidden, *tables[i], cache)
        yield hidden


def ttt_loss(
    draft: Eagle3Draft,
    aux: torch.Tensor,
    input_ids: torch.Tensor,
    target_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    ttt_length: int = 7,
    decay: float = 0.8,
    target_probs: torch.Tensor | None = None,
    fused: bool = True,
    docs: Documents | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """aux [B,T,3Ht]; input_ids, target_ids (target argmax per position), loss_mask [B,T];
    target_probs [B,T,N] over the draft vocabulary (soft targets) or None (hard: target_ids);
    docs: the documents of packed rows (packing.py), None for one sample per row.

    Returns the weighted loss and per-step detached metrics (loss_i, acc_i, tokens_i)."""
    b, t = input_ids.shape
    dev = input_ids.device
    ar = torch.arange(t, device=dev)
    outs, tgts, valids, weights, rows = [], [], [], [], []
    doc_ids = None if docs is None else docs.doc_ids(dev)
    for i, hidden in enumerate(unroll(draft, aux, input_ids, ttt_length, docs, doc_ids)):
        tgt = draft.t2d_index[_shift(target_ids, 1 + i)]
        valid = _shift(loss_mask, 2 + i).bool() & (tgt >= 0)
        if doc_ids is not None:  # the token learnt from is in this position's own document
            valid = valid & (_shift(doc_ids, 2 + i) == doc_ids)
        n = valid.sum().clamp(min=1)
        outs.append(hidden)
        tgts.append(tgt.clamp(min=0))
        valids.append(valid)
        weights.append(valid.float() * (decay**i) / n)
        # soft targets: row b*T + (t+1+i) of the flattened table (clamped: rows past the end are not counted)
        rows.append(torch.arange(b, device=dev)[:, None] * t + (ar + 1 + i).clamp(max=t - 1)[None])
    x = draft.norm(torch.stack(outs)).flatten(0, 2)  # [steps*B*T, H]
    tgt_all, valid_all = torch.stack(tgts).flatten(), torch.stack(valids).flatten()
    kw = (
        {"target_probs": target_probs.flatten(0, 1), "prob_rows": torch.stack(rows).flatten()}
        if target_probs is not None
        else {"target_ids": tgt_all}
    )
    total, ce, arg = (head_loss if fused else reference_loss)(
        x, draft.lm_head.weight, torch.stack(weights).flatten(), **kw
    )
    metrics: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        per = b * t
        for i in range(ttt_length):
            sl = slice(i * per, (i + 1) * per)
            v, n = valid_all[sl], valid_all[sl].sum()
            metrics[f"loss_{i}"] = (ce[sl] * v).sum() / n.clamp(min=1)
            metrics[f"acc_{i}"] = ((arg[sl] == tgt_all[sl]) & v).sum().float() / n.clamp(min=1)
            metrics[f"tokens_{i}"] = n
    return total, metrics


class TTTModule(torch.nn.Module):
    """The draft with the TTT loss as its forward (the trainer's module: train() mode, one call a step)."""

    def __init__(self, draft: Eagle3Draft, ttt_length: int, decay: float):
        super().__init__()
        self.draft = draft
        self.ttt_length, self.decay = ttt_length, decay

    def forward(self, aux, input_ids, target_ids, loss_mask, target_probs=None, docs=None):
        return ttt_loss(
            self.draft,
            aux,
            input_ids,
            target_ids,
            loss_mask,
            self.ttt_length,
            self.decay,
            target_probs,
            docs=docs,
        )
