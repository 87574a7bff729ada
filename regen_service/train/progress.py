"""What a person watching `regen train` reads: a progress line, and a loud warning when the draft does not learn.

The progress line (every `log_every_steps`, rank 0) gives steps of `total_steps`, samples, tokens/s over
all ranks, the ETA to `total_steps` (the run's length: every shard x epochs, the cosine's horizon), the
last held-out accept length and, with --follow, the shards consumed against the run's total. On a
terminal it is printed with rich (colour, one line per update, so the log lines around it stay
readable); otherwise it is a plain log line.

`not_learning` reads one evaluation after the warm-up: an accept length that stays ~1.0 (< 1.05 at k >= 2
draft tokens) or a step-0 loss near ln(draft vocab) means the draft learns nothing; the likely causes
come in order, each with the figure that points at it: a flat target distribution (its mean entropy over
the draft vocabulary against ln N: soft targets then teach nothing), wrong aux layers (their ids against
the target's depth), a vocabulary mismatch (the draft vocabulary's coverage, and the share of answer
positions whose target token it lacks). The caller logs it as a WARNING and puts it in the summary.
"""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger(__name__)

ACCEPT_FLOOR = 1.05  # accept length at k >= 2 below this: nothing accepted to speak of
LOSS_CEILING = 0.9  # step-0 loss above this share of ln(draft vocab): no better than uniform
FLAT_ENTROPY = 0.75  # target entropy above this share of ln(draft vocab): a flat target


def _dur(s: float) -> str:
    s = int(max(0, s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class Progress:
    def __init__(self, total_steps: int, num_shards: int | None, follow: bool, stream=None):
        self.total, self.num_shards, self.follow = total_steps, num_shards, follow
        self.stream = stream or sys.stderr
        self._t0, self._step0 = time.monotonic(), None
        self._console = None
        if getattr(self.stream, "isatty", lambda: False)():
            from rich.console import Console

            self._console = Console(file=self.stream, highlight=False)

    def line(self, step: int, samples: int, tok_s: float, shards: int, eval_al: tuple | None) -> str:
        if self._step0 is None:
            self._step0, self._t0 = step, time.monotonic()
        rate = (step - self._step0) / max(1e-9, time.monotonic() - self._t0)
        eta = _dur((self.total - step) / rate) if rate > 0 and step < self.total else "-"
        parts = [
            f"step {step}/{self.total} ({100 * step / max(1, self.total):.1f}%)",
            f"samples {samples}",
            f"{tok_s:,.0f} tok/s",
            f"ETA {eta}",
        ]
        if self.follow and self.num_shards:
            parts.append(f"shards {shards}/{self.num_shards}")
        parts.append(f"eval accept@{eval_al[0]} {eval_al[1]:.3f}" if eval_al else "eval -")
        return " | ".join(parts)

    def show(self, text: str) -> None:
        if self._console is not None:
            self._console.print(f"[bold cyan]train[/] {text}")
        else:
            log.info("progress: %s", text)


def not_learning(res: dict, k: int, aux_layer_ids, num_layers: int, vocab_stats: dict | None) -> dict | None:
    """The verdict on one evaluation after warm-up (None = learning), with the likely causes in order."""
    ln_n = res["ln_draft_vocab"]
    al = res["accept_length"].get(str(max(2, min(k, len(res["accept_length"])))))
    loss0 = (res["loss_per_step"] or [None])[0]
    signs = []
    if al is not None and al < ACCEPT_FLOOR:
        signs.append(f"held-out accept length {al:.3f} at k={max(2, k)} (< {ACCEPT_FLOOR})")
    if loss0 is not None and loss0 > LOSS_CEILING * ln_n:
        signs.append(f"step-0 eval loss {loss0:.3f} near ln(draft vocab) {ln_n:.3f}")
    if not signs:
        return None
    ent = res["target_entropy"]
    cov = (vocab_stats or {}).get("coverage")
    causes = [
        f"flat target distribution: the target's mean next-token entropy on the eval set is "
        f"{ent if ent is None else round(ent, 3)} nats over the draft vocabulary (ln N = {ln_n:.3f}; a trained "
        f"LLM sits far below it){' <- likely' if ent is not None and ent > FLAT_ENTROPY * ln_n else ''}: soft "
        "targets teach nothing then; check --target is the trained model, or try target: hard",
        f"wrong aux layers: captured layer inputs {list(aux_layer_ids)} of {num_layers} layers (default "
        "[2, L//2, L-3]); a draft served with other layers, or a model whose hidden states differ there, "
        "does not learn",
        f"vocabulary mismatch / low coverage: the draft vocabulary covers {cov} of the counted answer tokens "
        f"and misses the target's token at {res['oov_share']} of eval positions; raise draft_vocab_size or "
        "vocab_shards, and check the tokenizer is the target's",
    ]
    return {"signs": signs, "likely_causes": causes, "target_entropy": ent, "ln_draft_vocab": ln_n}


def warn_not_learning(verdict: dict, step: int) -> None:
    log.warning(
        "THE DRAFT IS NOT LEARNING (eval at step %d): %s. Likely causes, in order: %s",
        step, "; ".join(verdict["signs"]),
        " | ".join(f"({i + 1}) {c}" for i, c in enumerate(verdict["likely_causes"])),
    )  # fmt: skip
