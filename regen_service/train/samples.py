"""One training sample per generation: the exact prompt the target saw, plus its answer.

A multi-turn row holds several generations. Templates such as Kimi-K2.5's drop the thinking of
earlier turns when the conversation goes on, so one rendering of the final conversation is NOT what
the target saw while answering: it trains earlier answers in a context the target never produced
(or leaves them unsupervised). Per generation instead:
- api generate rows (turns[].output_ids): the turn's stored prompt ids (`prompt_ids`, or the row's
  `input_ids[:prompt_len]`) followed by its output ids, loss on the output: token-exact;
- rows rendered by the template (api chat): the template's generation prompt over the messages before
  the turn, followed by the turn as the target wrote it (its reasoning, then what the template renders
  for the message), loss on the answer.
`conversation` keeps today's one sample per row, right for templates that keep all thinking; `auto`
picks per generation when the template drops earlier thinking (ChatRenderer.drops_thinking). Reading
shards and batching are data.py's.
"""

from __future__ import annotations

import torch

from schemas.rows import OutputRow, Turn

THINK_END = "</think>"


def token_generations(
    row: OutputRow, max_length: int | None = None
) -> list[tuple[list[int], list[int]]] | None:
    """(ids, mask) per api-generate turn from stored ids, each cut to max_length; None when the row
    lacks per-turn prompts (written before they were stored) or has no generate turns: the caller uses
    the row as a whole. row.input_ids may already be cut to max_length (data._cut_token_columns)."""
    turns = [t for t in row.turns or [] if t.output_ids is not None]
    if not turns or any(t.prompt_len is None for t in turns):
        return None
    ids = row.input_ids or []
    cap = max_length if max_length is not None else max(len(ids), *(t.prompt_len for t in turns))
    out = []
    for t in turns:
        if t.prompt_ids is not None:
            if len(t.prompt_ids) != t.prompt_len:
                return None  # inconsistent row: do not guess
            prompt = list(t.prompt_ids[:cap])
        else:
            prompt = list(ids[: min(t.prompt_len, cap)])
            if len(prompt) != min(t.prompt_len, cap):
                return None
        answer = list(t.output_ids[: cap - len(prompt)])
        out.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return out


def _thinking_on(turn: Turn, message: dict) -> bool:
    # The raw text of a thinking turn holds `</think>` (chat: reasoning</think>content); a stored
    # reasoning_content says the same when the text is missing.
    if turn.text is not None:
        return THINK_END in turn.text
    return message.get("reasoning_content") is not None


def generation_turns(messages: list[dict], turns: list[Turn]) -> list[tuple[int, bool]]:
    """(message index, thinking on) of each regenerated turn, in the order template_generations gives
    its samples: the sample of turn i renders messages[: i + 1]."""
    by_index = {t.message_index: t for t in turns or []}
    targets = sorted(i for i in by_index if i is not None and 0 <= i < len(messages))
    return [(i, _thinking_on(by_index[i], messages[i])) for i in targets]


def template_generations(
    renderer, messages: list[dict], tools, turns: list[Turn], max_length: int | None = None
):
    """(ids, mask) per regenerated assistant turn of a template-rendered row (`messages` in the
    template form, data.template_messages); None when a turn cannot be aligned with the template (the
    caller then uses the conversation-level sample)."""
    targets = generation_turns(messages, turns)
    if not targets:
        return None
    out = []
    for i, thinking in targets:
        msg = messages[i]
        if msg.get("role") != "assistant":
            return None
        prompt = renderer.render(messages[:i], tools, add_generation_prompt=True, thinking=thinking)
        base = renderer.render(messages[:i], tools, thinking=thinking)
        gen = prompt[len(base) :] if prompt.startswith(base) else ""
        full = renderer.render(messages[: i + 1], tools, thinking=thinking)
        at = full.rfind(gen) if gen else -1
        if at < 0:
            return None
        rest = full[at + len(gen) :]
        reasoning = msg.get("reasoning_content") or ""
        if thinking and not rest.startswith(reasoning):
            rest = reasoning + rest  # the template dropped it from this rendering; the target wrote it
        ids, mask = renderer.tokenize_spans(
            prompt + rest, [(len(prompt), len(prompt) + len(rest))], max_length
        )
        out.append((ids, mask))
    return out


def as_examples(pairs, example_cls) -> list:
    return [
        example_cls(torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.int64))
        for ids, mask in pairs
    ]
