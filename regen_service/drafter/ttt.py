"""Training-time test (TTT): the EAGLE-3 loss, unrolled over `ttt_length` draft steps.

Alignment (SpecForge's): at step i the draft sits at position t with position id t + i, reads the
embedding of token x[t+1+i], and learns the target's greedy prediction at position t+1+i (the
target's next token after x[t+1+i]). Step 0's hidden input is fc(aux hidden states of position t);
step i > 0 feeds the draft's own output hidden of step i-1 and attends to the step-0 prefix plus
its own earlier steps at the same position (the per-step k/v cache in model.Attention). A position
counts only when the predicted token is an assistant token (loss_mask of x[t+2+i]) and the target's
token is in the draft vocabulary (t2d): tokens outside it are masked out, not redistributed.
Step losses are weighted decay**i (0.8 by default). Imports torch only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from regen_service.drafter.model import Eagle3Draft


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x[:, t+k], zero past the end."""
    if k >= x.shape[1]:
        return torch.zeros_like(x)
    return torch.cat([x[:, k:], x.new_zeros(x.shape[0], k)], 1)


def ttt_loss(
    draft: Eagle3Draft,
    aux: torch.Tensor,
    input_ids: torch.Tensor,
    target_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    ttt_length: int = 7,
    decay: float = 0.8,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """aux [B,T,3Ht]; input_ids, target_ids (target argmax per position), loss_mask [B,T].

    Returns the weighted loss and per-step detached metrics (loss_i, acc_i, tokens_i)."""
    b, t = input_ids.shape
    hidden = draft.fc(aux.to(draft.fc.weight.dtype))
    positions = torch.arange(t, device=input_ids.device)[None].expand(b, t)
    cache: list = []
    total = hidden.new_zeros((), dtype=torch.float32)
    metrics: dict[str, torch.Tensor] = {}
    for i in range(ttt_length):
        ids_i = _shift(input_ids, 1 + i)
        tgt = draft.t2d_index[_shift(target_ids, 1 + i)]
        valid = _shift(loss_mask, 2 + i).bool() & (tgt >= 0)
        hidden, logits = draft.step(ids_i, hidden, positions + i, cache)
        ce = F.cross_entropy(logits.float().flatten(0, 1), tgt.clamp(min=0).flatten(), reduction="none")
        n = valid.sum()
        loss_i = (ce * valid.flatten()).sum() / n.clamp(min=1)
        total = total + (decay**i) * loss_i
        with torch.no_grad():
            correct = ((logits.argmax(-1) == tgt) & valid).sum()
            metrics[f"loss_{i}"] = loss_i.detach()
            metrics[f"acc_{i}"] = correct.float() / n.clamp(min=1)
            metrics[f"tokens_{i}"] = n
    return total, metrics


class TTTModule(torch.nn.Module):
    """The draft with the TTT loss as its forward, so DistributedDataParallel can wrap it."""

    def __init__(self, draft: Eagle3Draft, ttt_length: int, decay: float):
        super().__init__()
        self.draft = draft
        self.ttt_length, self.decay = ttt_length, decay

    def forward(self, aux, input_ids, target_ids, loss_mask):
        return ttt_loss(self.draft, aux, input_ids, target_ids, loss_mask, self.ttt_length, self.decay)
