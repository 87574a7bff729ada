"""Prompt/response rows: `prompt`, optional `response`, optional `system`.

The legacy OpenAI fine-tuning format names the response `completion`: map it with
`fields: {response: completion}` in the mix. Completions in that format end with an end-of-text
marker (`<|endoftext|>` and friends) that was a training artifact, not text: it is stripped from
the end of the response (repeatedly, so "...<|endoftext|></s>" loses both), and nothing else is
changed. The prompt is kept verbatim, trailing newline included.
"""

from __future__ import annotations

from regen_service.produce.sources.base import Fields, Normalized, RowError, check_text, conversation, message

END_MARKERS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "</s>", "<eos>", "[EOS]")


def strip_end_markers(text: str) -> str:
    changed = True
    while changed:
        changed = False
        for marker in END_MARKERS:
            if text.endswith(marker):
                text = text[: -len(marker)]
                changed = True
    return text


def normalize(raw: dict, fields: Fields) -> Normalized:
    k_prompt, k_resp, k_sys = fields("prompt"), fields("response"), fields("system")
    if k_prompt not in raw:
        raise RowError(
            f"{k_prompt}: missing; a prompt_response row needs `{k_prompt}` (and optionally `{k_resp}`)"
        )
    prompt = check_text(raw[k_prompt], k_prompt)
    if not prompt.strip():
        raise RowError(f"{k_prompt}: empty prompt; nothing to prompt the target with")
    messages = []
    system = check_text(raw.get(k_sys), k_sys, allow_none=True)
    if system:
        messages.append(message("system", system))
    messages.append(message("user", prompt))
    if k_resp == "response" and "response" not in raw and "completion" in raw:
        raise RowError(
            "response: missing, but the row has `completion`; add `fields: {response: completion}` to the source"
        )
    response = check_text(raw.get(k_resp), k_resp, allow_none=True)
    if response is not None:
        messages.append(message("assistant", strip_end_markers(response)))
    return Normalized(conversation(messages, None, k_prompt))
