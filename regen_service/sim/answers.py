"""Deterministic answers: the generated token ids are a pure function of (seed, prompt).

`answer_key` hashes the seed with a canonical form of the prompt; `build_answer` draws everything
(length, thinking or not, tool call or not, the words) from an RNG seeded by that key, so a retried
prompt gets exactly the same ids. Sampling parameters other than max_new_tokens are ignored on
purpose. Timing, faults and HTTP shapes are left to capacity.py, faults.py and the route modules.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from dataclasses import dataclass
from typing import Literal

from regen_service.sim.config import SimConfig
from regen_service.sim.tokenize import IM_END, WORDS, Tokenizer, tool_section

ThinkMode = Literal["open", "off", "free"]
_TOOLS_RE = re.compile(r"<\|im_system\|>tool_declare<\|im_middle\|>(.*?)<\|im_end\|>", re.DOTALL)


def answer_key(seed: int, kind: str, prompt) -> bytes:
    """sha256 over the seed and the canonical JSON of the prompt (messages+tools, ids, or text)."""
    canon = json.dumps(prompt, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(f"{seed}\0{kind}\0{canon}".encode()).digest()


def think_mode(prompt_text: str) -> ThinkMode:
    """Kimi's generation prompt ends with `<think>` (thinking) or `<think></think>` (instant)."""
    if prompt_text.endswith("<think></think>"):
        return "off"
    if prompt_text.endswith("<think>"):
        return "open"
    return "free"


def tools_in_prompt(prompt_text: str) -> tuple[list[dict] | None, bool]:
    """For /generate: the tools declared in a Kimi-templated prompt, and whether the last turn is the user's."""
    m = _TOOLS_RE.search(prompt_text)
    tools = None
    if m:
        try:
            tools = json.loads(m.group(1))
        except ValueError:
            tools = _typescript_tools(m.group(1))
    turns = prompt_text.split(IM_END)
    last_user = len(turns) >= 2 and turns[-2].lstrip().startswith("<|im_user|>")
    return (tools if isinstance(tools, list) and tools else None), last_user


_TS_TYPE = re.compile(r"^type (\w+) = \(_: ", re.M)
_TS_FIELD = re.compile(r"^  (\w+)(\??): (string|number|boolean)\b", re.M)


def _typescript_tools(text: str) -> list[dict] | None:
    """Tools declared TypeScript-style (Kimi-K2.5's `tools_ts_str`): names and top-level scalar fields."""
    starts = list(_TS_TYPE.finditer(text))
    tools = []
    for k, m in enumerate(starts):
        body = text[m.end() : starts[k + 1].start() if k + 1 < len(starts) else len(text)]
        fields = _TS_FIELD.findall(body)
        params = {
            "type": "object",
            "properties": {name: {"type": kind} for name, _, kind in fields},
            "required": [name for name, opt, _ in fields if not opt],
        }
        tools.append({"type": "function", "function": {"name": m.group(1), "parameters": params}})
    return tools or None


@dataclass(frozen=True)
class ToolCallOut:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class Answer:
    """The full answer's ids and where its parts lie ([start, end) index ranges into ids)."""

    ids: list[int]
    reasoning: tuple[int, int] | None
    content: tuple[int, int]
    tool: tuple[int, int] | None
    tool_call: ToolCallOut | None


def build_answer(
    key: bytes,
    cfg: SimConfig,
    tok: Tokenizer,
    mode: ThinkMode,
    tools: list[dict] | None,
    tool_eligible: bool,
) -> Answer:
    rng = random.Random(int.from_bytes(key[:16], "big"))
    n = _draw_len(rng, cfg)
    # Draw every decision even when unused, so a config change moves no other answer's words.
    wants_think = rng.random() < cfg.think_prob
    wants_tool = rng.random() < cfg.tool_call_prob
    split = rng.uniform(0.3, 0.7)

    ids: list[int] = []
    reasoning = None
    thinks = mode != "off" and (wants_think or mode == "open")
    if thinks:
        if mode == "free":
            ids += tok.encode("<think>")
        r = max(1, int(n * split)) if wants_think else 0
        start = len(ids)
        ids += tok.filler(rng, r)
        reasoning = (start, len(ids))
        ids += tok.encode("</think>")
        n = max(1, n - r)

    call = None
    tool_range = None
    if tools and tool_eligible and wants_tool:
        call = _tool_call(rng, tools)
        content = (len(ids), len(ids))
        ids += tok.encode(tool_section([(call.name, call.arguments)]))
        tool_range = (content[1], len(ids))
    else:
        start = len(ids)
        ids += tok.filler(rng, n)
        content = (start, len(ids))
    return Answer(ids=ids, reasoning=reasoning, content=content, tool=tool_range, tool_call=call)


def _draw_len(rng: random.Random, cfg: SimConfig) -> int:
    mean = cfg.answer_len_mean
    if cfg.answer_len_dist == "fixed":
        n = mean
    elif cfg.answer_len_dist == "uniform":
        n = rng.randint(1, 2 * mean - 1) if mean > 1 else 1
    else:
        sigma = 0.8
        n = round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma))
    return max(1, min(n, cfg.answer_len_max))


def _tool_call(rng: random.Random, tools: list[dict]) -> ToolCallOut:
    fn = rng.choice(tools)
    fn = fn.get("function", fn) if isinstance(fn, dict) else {}
    params = fn.get("parameters") or {}
    props = params.get("properties") or {}
    required = set(params.get("required") or [])
    args = {}
    for name in sorted(props):
        keep = rng.random() < 0.5
        if name in required or keep:
            args[name] = _value(rng, props[name] if isinstance(props[name], dict) else {})
    return ToolCallOut(name=str(fn.get("name", "tool")), arguments=json.dumps(args))


def _value(rng: random.Random, schema: dict):
    if schema.get("enum"):
        return rng.choice(schema["enum"])
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = kind[0] if kind else "string"
    if kind == "integer":
        return rng.randint(0, 100)
    if kind == "number":
        return round(rng.uniform(0, 100), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [_value(rng, schema.get("items") or {}) for _ in range(rng.randint(1, 3))]
    if kind == "object":
        return {}
    return " ".join(rng.choices(WORDS, k=rng.randint(1, 4)))
