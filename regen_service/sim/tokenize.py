"""Token ids for the simulator: a built-in synthetic vocabulary, or a local Hugging Face tokenizer.

Both (the second is in hf.py) give the same small interface: `count` (prompt tokens), `encode`/`decode` (exact on generated
text, so decode(output_ids) == text), `filler` (n token ids of plausible words for an answer) and
`render_chat` (the Kimi chat template applied with add_generation_prompt). What the answer says is
decided in answers.py; this module only turns text into ids and back.

Synthetic vocabulary: ids 0-255 are bytes (fallback for anything not a word), ids 1000.. are words
with a leading space, the Kimi markers keep Kimi's ids. Prompt tokens are counted approximately: one
per word, one per punctuation character, one per marker.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from bisect import bisect_right
from itertools import repeat
from typing import Protocol

from regen_service.sim.images import IMAGE_TEXT

MARKERS = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|im_end|>": 163586,
    "<|im_user|>": 163587,
    "<|im_assistant|>": 163588,
    "<|im_system|>": 163594,
    "<|im_middle|>": 163601,
    "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599,
    "<|media_begin|>": 163602,
    "<|media_content|>": 163603,
    "<|media_end|>": 163604,
    "<|media_pad|>": 163605,
    "<think>": 163606,
    "</think>": 163607,
}
IM_END = "<|im_end|>"
SYNTHETIC_VOCAB_SIZE = 163840

_COMMON = """the of and to in is that it for was on are as with his they at be this from have or by one
had not but what all were when we there can an your which their said if do will each about how up out
them then she many some so these would other into has more her two like him see time could no make than
first been its who now people my made over did down only way find use may water long little very after
words called just where most know get through back much before go good new write our used me man too any
day same right look think also around another came come work three word must because does part even place
well such here take why things help put years different away again off went old number great tell men say
small every found still between name should home big give air line set own under read last never us left
end along while might next sound below saw something thought both few those always looked show large often
together asked house world going want school important until form food keep children feet land side without
boy once animals life enough took sometimes four head above kind began almost live page got earth need far
hand high year mother light parts country father let night following picture being study second eyes soon
answer model data token draft server request value result function system method step first check""".split()
_ONSETS = "b c d f g h j k l m n p r s t v w z br cl dr fl gr pl st tr".split()
_VOWELS = "a e i o u ai ea io".split()


def _build_words() -> list[str]:
    syllables = [o + v for o, v in itertools.product(_ONSETS, _VOWELS)]
    rng = random.Random(20240601)  # fixed: the vocabulary must never change between runs
    seen = dict.fromkeys(_COMMON)
    while len(seen) < 4000:
        seen.setdefault("".join(rng.choice(syllables) for _ in range(rng.randint(2, 3))), None)
    return list(seen)


WORDS = _build_words()
# Common words come up ten times as often as made-up ones, so generated text reads less like noise.
_NUM_COMMON = len(dict.fromkeys(_COMMON))
_CUM_WEIGHTS = list(itertools.accumulate(10 if i < _NUM_COMMON else 1 for i in range(len(WORDS))))
_CUM_TOTAL = _CUM_WEIGHTS[-1] + 0.0
_WORD_BASE = 1000
_PERIOD, _COMMA = ord("."), ord(",")
_MARKER_RE = "|".join(re.escape(m) for m in MARKERS)
_ENCODE_RE = re.compile(rf"{_MARKER_RE}| ?[A-Za-z]+|.", re.DOTALL)
_COUNT_RE = re.compile(rf"{_MARKER_RE}|\w+|[^\w\s]")


class Tokenizer(Protocol):
    path: str | None
    im_end_id: int
    media_pad_id: int | None  # the image placeholder's id (Kimi's <|media_pad|>), None when absent

    def count(self, text: str) -> int: ...
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def filler(self, rng: random.Random, n: int) -> list[int]: ...
    def render_chat(
        self, messages: list[dict], tools: list[dict] | None, kwargs: dict
    ) -> tuple[str, int]: ...


class SyntheticTokenizer:
    """Word-level ids over WORDS plus byte fallback; no files, no downloads."""

    path = None

    def __init__(self) -> None:
        self._id_of = {" " + w: _WORD_BASE + i for i, w in enumerate(WORDS)} | dict(MARKERS)
        self._str_of = {v: k for k, v in self._id_of.items()}
        self.im_end_id = MARKERS[IM_END]
        self.media_pad_id = MARKERS["<|media_pad|>"]

    def count(self, text: str) -> int:
        return len(_COUNT_RE.findall(text))

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _ENCODE_RE.findall(text):
            tid = self._id_of.get(piece)
            if tid is None:
                ids.extend(piece.encode("utf-8"))
            else:
                ids.append(tid)
        return ids

    def decode(self, ids: list[int]) -> str:
        out: list[str] = []
        pending = bytearray()
        for tid in ids:
            if tid < 256:
                pending.append(tid)
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            out.append(self._str_of.get(tid, ""))
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def filler(self, rng: random.Random, n: int) -> list[int]:
        if n <= 0:
            return []
        # rng.choices(range(len(WORDS)), cum_weights=_CUM_WEIGHTS, k=n) inlined: the same draws (one
        # random() per token, bisected the same way), without a second pass to add _WORD_BASE.
        rand, total, hi = rng.random, _CUM_TOTAL, len(_CUM_WEIGHTS) - 1
        ids = [_WORD_BASE + bisect_right(_CUM_WEIGHTS, rand() * total, 0, hi) for _ in repeat(None, n)]
        # Sentences of 6-20 tokens, so the text reads like text and byte tokens appear too.
        i = rng.randint(6, 20)
        while i < n:
            ids[i] = _PERIOD if rng.random() < 0.7 else _COMMA
            i += rng.randint(6, 20)
        return ids

    def render_chat(self, messages: list[dict], tools: list[dict] | None, kwargs: dict) -> tuple[str, int]:
        text = render_kimi_chat(messages, tools, kwargs)
        return text, self.count(text)


def word_weights() -> list[int]:
    """Cumulative weights over WORDS for rng.choices."""
    return _CUM_WEIGHTS


def render_kimi_chat(messages: list[dict], tools: list[dict] | None, kwargs: dict) -> str:
    """Kimi-K2.5's chat layout, enough for token counts and for the thinking/tool decisions."""
    parts: list[str] = []
    if tools:
        parts.append(
            f"<|im_system|>tool_declare<|im_middle|>{json.dumps(tools, separators=(',', ':'))}{IM_END}"
        )
    for m in messages:
        role = m.get("role", "user")
        tag = {"user": "user", "assistant": "assistant"}.get(role, "system")
        body = _content_text(m.get("content"))
        if role == "assistant":
            body = f"<think>{m.get('reasoning_content') or ''}</think>{body}"
            calls = m.get("tool_calls") or []
            if calls:
                body += tool_section([(c.get("function", c).get("name", ""), _args(c)) for c in calls])
        parts.append(f"<|im_{tag}|>{m.get('name') or role}<|im_middle|>{body}{IM_END}")
    parts.append("<|im_assistant|>assistant<|im_middle|>")
    parts.append("<think></think>" if kwargs.get("thinking") is False else "<think>")
    return "".join(parts)


def tool_section(calls: list[tuple[str, str]]) -> str:
    """Kimi's tool-call section text for (name, JSON arguments) pairs."""
    inner = "".join(
        f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{args}<|tool_call_end|>"
        for i, (name, args) in enumerate(calls)
    )
    return f"<|tool_calls_section_begin|>{inner}<|tool_calls_section_end|>"


def _args(call: dict) -> str:
    args = call.get("function", call).get("arguments", "{}")
    return args if isinstance(args, str) else json.dumps(args)


def _content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    # OpenAI content parts: text as is, an image as Kimi-K2.5's template renders it (its placeholder)
    return "".join(
        IMAGE_TEXT if p.get("type") == "image_url" else p.get("text", "")
        for p in content
        if isinstance(p, dict)
    )
