"""The target's chat format on the client side: prompt ids for api generate, and parsing raw output.

For `api: generate` regen renders the prompt itself with the target tokenizer's chat template, so
the ids the server sees are exactly those the trainer will see. Raw output text follows Kimi-K2.5's
format: the generation prompt ends with `<think>` (thinking on) or `<think></think>` (off), so the
text is `reasoning</think>answer`, and tool calls are
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
_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*(?P<id>.*?)\s*<\|tool_call_argument_begin\|>(?P<args>.*?)\s*<\|tool_call_end\|>",
    re.S,
)


def message_dict(m: Message) -> dict:
    """A Message as the OpenAI-style dict both the chat API and HF chat templates take."""
    d: dict = {"role": m.role, "content": m.content}
    if m.reasoning_content is not None:
        d["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        d["tool_calls"] = [
            {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}
            for tc in m.tool_calls
        ]
    if m.name is not None:
        d["name"] = m.name
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    return d


def prompt_ids(
    tokenizer, messages: list[Message], tools: tuple[dict, ...] | None, *, thinking: bool
) -> list[int]:
    """input_ids of the generation prompt, through the tokenizer's own template (add_generation_prompt)."""
    try:
        out = tokenizer.apply_chat_template(
            [message_dict(m) for m in messages],
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


def split_thinking(text: str, *, prompt_opens_think: bool, truncated: bool) -> tuple[str | None, str]:
    """(reasoning, answer) from raw text; like SGLang's kimi_k2 parser, everything before `</think>`
    is reasoning. With no `</think>`, the text is all reasoning only when the prompt opened `<think>`
    and the answer was cut by the length limit (thinking never ended); otherwise it is all answer."""
    if THINK_END in text:
        reasoning, answer = text.split(THINK_END, 1)
        if reasoning.startswith(THINK_START):
            reasoning = reasoning[len(THINK_START) :]
        return reasoning, answer
    if text.startswith(THINK_START) or (prompt_opens_think and truncated):
        return text.removeprefix(THINK_START), ""
    return None, text


def parse_tool_calls(answer: str) -> tuple[str, list[ToolCall] | None]:
    """(content, tool calls) from the answer part of raw Kimi output; the stop marker is dropped."""
    if answer.endswith(STOP_TEXT):
        answer = answer[: -len(STOP_TEXT)]
    if CALLS_BEGIN not in answer:
        return answer, None
    content, section = answer.split(CALLS_BEGIN, 1)
    section = section.split(CALLS_END, 1)[0]
    calls = []
    for m in _CALL.finditer(section):
        call_id = m.group("id")
        # "functions.get_weather:0" -> get_weather
        name = call_id.split(".", 1)[-1].rsplit(":", 1)[0]
        calls.append(ToolCall(id=call_id, name=name, arguments=m.group("args").strip() or "{}"))
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
