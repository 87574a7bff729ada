"""The target's chat format on the client side: prompt ids for api generate, and parsing raw output.

For `api: generate` regen renders the prompt itself with the target tokenizer's chat template, so
the ids the server sees are exactly those the trainer will see. Raw output text follows Kimi-K2.5's
format: the generation prompt ends with `<think>` (thinking on) or `<think></think>` (off), so the
text is `reasoning</think>answer` (or reasoning running straight into a tool-call section), split
the way SGLang's `kimi_k2` reasoning and tool-call parsers split it, and tool calls are
`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
<|tool_call_end|><|tool_calls_section_end|>`. Loading the tokenizer is the worker's job.
"""

from __future__ import annotations

import re

from regen_service.errors import RowTerminalError
from schemas.conversation import Message, ToolCall

THINK_END = "</think>"
THINK_START = "<think>"
STOP_TEXT = "<|im_end|>"
CALLS_BEGIN = "<|tool_calls_section_begin|>"
CALLS_END = "<|tool_calls_section_end|>"
# SGLang's KimiK2Detector patterns (python/sglang/srt/function_call/kimik2_detector.py): no DOTALL,
# so arguments spread over several lines are not a call there, and not here either.
_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?P<id>[\w\.]+:\d+)\s*<\|tool_call_argument_begin\|>\s*(?P<args>\{.*?\})\s*<\|tool_call_end\|>"
)
_CALL_ID = re.compile(r"^(?:functions\.)?(?P<name>[\w\.]+):(?P<index>\d+)$")


def prompt_ids(
    tokenizer, messages: list[Message], tools: tuple[dict, ...] | None, *, thinking: bool
) -> list[int]:
    """input_ids of the generation prompt, through the tokenizer's own template (add_generation_prompt)."""
    try:
        out = tokenizer.apply_chat_template(
            [m.to_dict("template") for m in messages],
            tools=list(tools) if tools else None,
            add_generation_prompt=True,
            tokenize=True,
            thinking=thinking,
        )
    except Exception as e:  # a template that cannot render this conversation: the row's problem
        raise RowTerminalError(
            f"the chat template cannot render this conversation: {type(e).__name__}: {e}"
        ) from e
    # transformers 5 returns a BatchEncoding here, 4.x a plain list.
    ids = out["input_ids"] if hasattr(out, "keys") else out
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(i) for i in ids]


def split_thinking(text: str, *, prompt_opens_think: bool) -> tuple[str | None, str]:
    """(reasoning, answer) from raw text, as SGLang's `kimi_k2` reasoning parser splits it
    (KimiK2Detector.detect_and_parse): the text is reasoning when the prompt opened `<think>` (SGLang's
    force_reasoning) or the text itself has `<think>`; leading `<think>`s are dropped; reasoning ends at
    the first `</think>`, or, when `</think>` never came, at `<|tool_calls_section_begin|>` (which stays
    in the answer for the tool-call parser); with neither marker it is all reasoning. A trailing
    `<|im_end|>` (the stop token, kept by skip_special_tokens=False) is not part of either."""
    text = text.removesuffix(STOP_TEXT)
    if not (prompt_opens_think or THINK_START in text):
        return None, text
    while text.startswith(THINK_START):
        text = text[len(THINK_START) :]
    if THINK_END in text:
        reasoning, answer = text.split(THINK_END, 1)
        return reasoning, answer
    at = text.find(CALLS_BEGIN)
    if at >= 0:
        return text[:at], text[at:]
    return text, ""


def parse_tool_calls(answer: str) -> tuple[str, list[ToolCall] | None]:
    """(content, tool calls) from the answer part of raw Kimi output, as SGLang's `kimi_k2` tool parser
    (KimiK2Detector.detect_and_parse) reads it: content is what precedes `<|tool_calls_section_begin|>`;
    each call is `<|tool_call_begin|>ID<|tool_call_argument_begin|>{json}<|tool_call_end|>` with ID
    `[functions.]NAME:INDEX` (the name without its `functions.` prefix and index). The stop marker is
    dropped; calls that do not match the pattern are not calls, as in SGLang."""
    answer = answer.removesuffix(STOP_TEXT)
    if CALLS_BEGIN not in answer:
        return answer, None
    content = answer[: answer.find(CALLS_BEGIN)]
    calls = []
    for m in _CALL.finditer(answer):
        name = _CALL_ID.match(m.group("id"))
        if name is None:
            continue
        calls.append(ToolCall(id=m.group("id"), name=name.group("name"), arguments=m.group("args")))
    return content, calls or None


def find_span(haystack: list[int], needle: list[int], start: int) -> int:
    """Index of `needle` inside `haystack` at or after `start`, or -1."""
    n = len(needle)
    if n == 0:
        return -1
    first = needle[0]
    for i in range(start, len(haystack) - n + 1):
        if haystack[i] == first and haystack[i : i + n] == needle:
            return i
    return -1


def loss_mask_for(
    last_prompt: list[int], last_output: list[int], earlier_outputs: list[list[int]]
) -> list[int]:
    """1 on the last output and on each earlier output found verbatim (in order) in the last prompt."""
    mask = [0] * len(last_prompt) + [1] * len(last_output)
    pos = 0
    for out in earlier_outputs:
        at = find_span(last_prompt, out, pos)
        if at < 0:
            continue  # the template re-rendered it (e.g. dropped old thinking): not the target's exact tokens
        mask[at : at + len(out)] = [1] * len(out)
        pos = at + len(out)
    return mask
