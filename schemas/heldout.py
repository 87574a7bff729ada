"""The held-out split of a run: the prompts a trainer never trains on and evaluates the draft with.

One rule, read by every process that needs it (the trainer's evaluation, `regen eval-draft`, a user's
notebook): a prompt is held out when a hash of (split seed, prompt id) falls below the fraction. The
prompt id is the content hash the producer gives every prompt, so the split does not depend on shard
order, shard size, world size, restarts or which trainer reads which shard, and every generation of a
multi-turn prompt lands on the same side. Per source the held-out share is the fraction in expectation;
a source with few prompts can end up with none, which the trainer reports. Which fraction and seed a
draft was trained with is recorded in its checkpoint (the trainer's business, not this module's).
"""

from __future__ import annotations

import hashlib

from pydantic import BaseModel, ConfigDict, Field

# Bumped if the rule ever changes: a checkpoint records it, so a draft is never evaluated on prompts it
# was trained on because the rule moved underneath it.
SPLIT_VERSION = 1


class HeldOutSplit(BaseModel):
    """Which prompts are held out: `fraction` of them by hash, chosen by `seed`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    seed: int = 0
    version: int = SPLIT_VERSION

    def holds_out(self, prompt_id: str) -> bool:
        return held_out(prompt_id, self.fraction, self.seed)


def held_out(prompt_id: str, fraction: float, seed: int = 0) -> bool:
    """True when the prompt belongs to the held-out split (never trained on)."""
    if fraction <= 0.0:
        return False
    digest = hashlib.sha256(f"regen-heldout-v{SPLIT_VERSION}:{seed}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64
