"""Build the small Kimi-style demo tokenizer in regen_service/demo/tokenizer/ (committed output).

The demo, the simulator and the tests need a tokenizer that behaves like Kimi-K2.5's (same special
tokens, same chat template shape, `<|im_end|>` as eos) without downloading the real 160K-vocab one.
This script trains a byte-level BPE (6K tokens) with `tokenizers` on built-in text (a paragraph below
plus the source of a few standard-library modules of the running Python) and the demo data's text (from
scripts/make_demo_data.py's generators, so no data file needs to exist yet), wraps it as a `transformers.PreTrainedTokenizerFast` and saves it with `save_pretrained`, so that
`AutoTokenizer.from_pretrained(dir)` loads it offline. Training is deterministic for
a given Python version: same script, same files.

The chat template (CHAT_TEMPLATE below) reproduces Kimi-K2's turn format:
- `<|im_system|>tool_declare<|im_middle|>{tools as compact JSON}<|im_end|>` first, when tools are given;
- `<|im_system|>system<|im_middle|>...`, `<|im_user|>user<|im_middle|>...`,
  `<|im_assistant|>assistant<|im_middle|>...`, tool results `<|im_system|>tool<|im_middle|>...`, each
  closed by `<|im_end|>`; no default system prompt is inserted (Kimi's template adds one; we leave it to
  the dataset so prompts hash and render the same way);
- assistant tool calls as `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{json args}<|tool_call_end|>...<|tool_calls_section_end|>`, IDX counting
  calls across the whole conversation (Kimi's convention); tool calls may be flat `{name, arguments}`
  (schemas.ToolCall) or OpenAI-shaped `{function: {name, arguments}}`; object arguments become JSON;
- thinking: assistant turns after the last user turn (the current turn, including its tool-call steps)
  render `<think>{reasoning_content}</think>{content}`; earlier assistant turns render
  `<think></think>{content}` (their thinking is dropped, as Kimi does for history);
- `add_generation_prompt` appends `<|im_assistant|>assistant<|im_middle|><think>` (thinking mode, the
  default) or `...<think></think>` when the template kwarg `thinking` is false.

Run: python scripts/build_demo_tokenizer.py   (then python scripts/make_demo_data.py, whose pretokenized
rows depend on these ids).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "regen_service" / "demo" / "tokenizer"
VOCAB_SIZE = 6000

# Kimi's structural tokens are special (skipped by decode(skip_special_tokens=True)); <think> and
# </think> are added but not special, so generated text keeps its thinking markers when decoded.
SPECIAL_TOKENS = [
    "[BOS]",
    "[EOS]",
    "[UNK]",
    "[PAD]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|media_start|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
]
THINK_TOKENS = ["<think>", "</think>"]

CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>"
    "{%- endif -%}"
    "{%- set ns = namespace(last_user=-1, call_idx=0) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}<|im_system|>system<|im_middle|>{{ m['content'] or '' }}"
    "{%- elif m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ m['content'] or '' }}"
    "{%- elif m['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>{{ m['content'] or '' }}"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.index0 > ns.last_user -%}<think>{{ m['reasoning_content'] or '' }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{{ m['content'] or '' }}"
    "{%- if m['tool_calls'] -%}<|tool_calls_section_begin|>"
    "{%- for tc in m['tool_calls'] -%}"
    "{%- set fn = tc['function'] if tc['function'] is defined else tc -%}"
    "<|tool_call_begin|>functions.{{ fn['name'] }}:{{ ns.call_idx }}<|tool_call_argument_begin|>"
    "{%- if fn['arguments'] is string -%}{{ fn['arguments'] }}"
    "{%- elif fn['arguments'] is defined and fn['arguments'] is not none -%}{{ fn['arguments'] | tojson }}"
    "{%- else -%}{}{%- endif -%}"
    "<|tool_call_end|>{%- set ns.call_idx = ns.call_idx + 1 -%}"
    "{%- endfor -%}<|tool_calls_section_end|>"
    "{%- endif -%}"
    "{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking is false -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)

BUILTIN_TEXT = """
The quick brown fox jumps over the lazy dog. A speculative decoding draft model proposes several tokens
and the target model verifies them in one forward pass; the accepted length decides the speed-up.
Explain the difference between a list and a tuple in Python. Lists are mutable; tuples are not.
def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
import json, os, sys
class Config:
    def __init__(self, path):
        self.path = path
for (int i = 0; i < n; ++i) { sum += values[i]; }
SELECT name, count(*) FROM users WHERE active = 1 GROUP BY name ORDER BY 2 DESC;
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"type": "function", "function": {"name": "search", "description": "Search the web", "parameters":
{"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
The weather today is sunny with a high of 24 degrees and a light breeze from the west.
Summarize the following paragraph in two sentences. Translate the sentence into French.
Write a short poem about the sea at night. What is the capital of Australia? Canberra.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1000 3.14159 2.71828 -1 1e-5 2024 2025
你好，请介绍一下你自己。我是一个人工智能助手，可以回答问题、写作和编程。
今天天气很好，我们去公园散步吧。请把这段话翻译成英文。机器学习是人工智能的一个分支。
Bonjour, comment allez-vous ? Très bien, merci. ¿Dónde está la biblioteca? Straße, Größe, naïve café.
Step 1: read the question carefully. Step 2: list what is known. Step 3: solve and check the answer.
Let x be the number of apples. Then 3x + 5 = 20, so 3x = 15 and x = 5.
<think>The user wants a concise answer. I should check the units first.</think>The answer is 12 km.
"""


STDLIB_MODULES = [
    "argparse", "asyncio", "collections", "csv", "dataclasses", "datetime", "decimal", "email", "functools",
    "http.client", "inspect", "itertools", "json", "logging", "os", "pathlib", "random", "re", "shutil",
    "sqlite3", "statistics", "string", "subprocess", "textwrap", "threading", "typing", "unittest", "urllib.parse",
]  # fmt: skip


def _stdlib_text() -> list[str]:
    """Docstrings and source of a few standard-library modules: varied English and Python, no download."""
    out = []
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        try:
            out.extend(inspect.getsource(module).split("\n\n"))
        except (OSError, TypeError):
            out.append(inspect.getdoc(module) or "")
    return [t for t in out if t.strip()]


def _demo_corpus() -> list[str]:
    """The demo data's text, from make_demo_data's generators (deterministic, no files needed)."""
    path = Path(__file__).resolve().parent / "make_demo_data.py"
    if not path.exists():
        return []
    spec = importlib.util.spec_from_file_location("_regen_make_demo_data", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return list(module.corpus_texts())


def build(out: Path = OUT) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS + THINK_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeating the built-in text gives its merges enough frequency next to the demo corpus.
    texts = [line for line in BUILTIN_TEXT.splitlines() if line.strip()] * 4 + _demo_corpus() + _stdlib_text()
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="[BOS]",
        eos_token="<|im_end|>",
        unk_token="[UNK]",
        pad_token="[PAD]",
        additional_special_tokens=[
            t for t in SPECIAL_TOKENS if t not in ("[BOS]", "<|im_end|>", "[UNK]", "[PAD]")
        ],
        model_max_length=262144,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return fast


def main() -> None:
    fast = build()
    demo = fast.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    print(f"wrote {OUT} (vocab {len(fast)}); generation prompt example: {demo!r}")


if __name__ == "__main__":
    main()
