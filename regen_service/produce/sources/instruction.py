"""Alpaca-style rows: `instruction`, optional `input`, optional `output`, optional `system`.

The user turn is the instruction, followed by "\\n\\n" and the input when the input is non-empty
(the Alpaca convention without its "### Instruction:" scaffolding, which would only teach the draft
a template the target never sees). `output` becomes the assistant turn that gets regenerated; a row
without it is still a valid prompt. Text is kept verbatim.
"""

from __future__ import annotations

from regen_service.produce.sources.base import Fields, Normalized, RowError, check_text, conversation, message


def normalize(raw: dict, fields: Fields) -> Normalized:
    k_ins, k_in, k_out, k_sys = fields("instruction"), fields("input"), fields("output"), fields("system")
    if k_ins not in raw:
        raise RowError(
            f"{k_ins}: missing; an instruction row needs `{k_ins}` (and optionally `{k_in}`, `{k_out}`)"
        )
    instruction = check_text(raw[k_ins], k_ins)
    extra = check_text(raw.get(k_in), k_in, allow_none=True) or ""
    if not instruction.strip() and not extra.strip():
        raise RowError(f"{k_ins}: empty instruction and input; nothing to prompt the target with")
    user = f"{instruction}\n\n{extra}" if extra and instruction else (instruction or extra)
    messages = []
    system = check_text(raw.get(k_sys), k_sys, allow_none=True)
    if system:
        messages.append(message("system", system))
    messages.append(message("user", user))
    output = check_text(raw.get(k_out), k_out, allow_none=True)
    if output is not None:
        messages.append(message("assistant", output))
    return Normalized(conversation(messages, None, k_ins))
