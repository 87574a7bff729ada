"""The draft vocabulary: which target ids the draft's lm_head can propose, frozen once built.

Rule (also in docs/training.md): count token ids over loss-masked (assistant) positions of the
first shards; keep the `draft_vocab_size` most frequent (ties: lower id first); if the data has
fewer distinct ids, pad with the lowest target ids not yet chosen (id 0, 1, 2, ...), so the table
always has exactly draft_vocab_size rows (a short table crashes SGLang). The chosen ids are sorted
ascending: `d2t[i] = used[i] - i` (int64 offsets; SGLang's hot_token_id = d2t + arange) and
`t2d` is a bool mask over the target vocabulary. Deciding how many shards/tokens feed the count is
the trainer's (TrainConfig.vocab_shards / vocab_tokens).
"""

from __future__ import annotations

import torch

from regen_service.errors import ConfigError


class VocabCounter:
    def __init__(self, vocab_size: int):
        self.counts = torch.zeros(vocab_size, dtype=torch.int64)
        self.tokens = 0

    def add(self, ids: torch.Tensor, loss_mask: torch.Tensor) -> None:
        sel = ids[loss_mask.bool()].long()
        if sel.numel():
            if int(sel.max()) >= self.counts.numel():
                raise ConfigError(
                    f"token id {int(sel.max())} is outside the target vocab ({self.counts.numel()})"
                )
            self.counts += torch.bincount(sel, minlength=self.counts.numel())
            self.tokens += sel.numel()


def build_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (d2t int64 [draft_vocab_size], t2d bool [vocab_size])."""
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ConfigError(
            f"draft_vocab_size {draft_vocab_size} must be in 1..{vocab_size} (the target vocab)"
        )
    ids = torch.arange(vocab_size)
    # stable sort on -count keeps lower ids first among equal counts
    order = ids[torch.sort(-counts, stable=True).indices]
    seen = order[counts[order] > 0][:draft_vocab_size]
    if seen.numel() < draft_vocab_size:
        mask = torch.ones(vocab_size, dtype=torch.bool)
        mask[seen] = False
        fill = ids[mask][: draft_vocab_size - seen.numel()]
        seen = torch.cat([seen, fill])
    used = torch.sort(seen).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return (used - torch.arange(draft_vocab_size)).to(torch.int64), t2d


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Share of counted tokens the draft vocabulary covers."""
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 0.0
