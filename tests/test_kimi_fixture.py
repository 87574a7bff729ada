"""The scaled-down Kimi-K2.5 folder end to end: its config, its slow tiktoken tokenizer (remote code,
opt-in only), its chat template's multi-turn thinking, and every command that takes a target folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from regen_service.cli import main
from regen_service.errors import ConfigError
from regen_service.kimi_fixture import build_kimi_fixture
from regen_service.remote_code import load_tokenizer, remote_code_files
from regen_service.train.data import ChatRenderer
from regen_service.work.chat_template import prompt_ids
from regen_service.work.client.config import PoolConfig
from regen_service.work.runtime import WorkerRuntime
from regen_service.work.worker_config import WorkerConfig
from schemas.conversation import Message
from schemas.mix import TargetSpec

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather of a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "city": {"type": "string", "description": "City name"},
                },
                "required": ["city"],
            },
        },
    }
]
CALL = {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> Path:
    return build_kimi_fixture(tmp_path_factory.mktemp("kimi") / "Kimi-K2.5")


@pytest.fixture(scope="module")
def kimi_tok(kimi_dir):
    return load_tokenizer(kimi_dir, trust_remote_code=True, setting="test")


def render(tok, messages, add_generation_prompt=False, **kw) -> str:
    # explicit: Kimi's apply_chat_template defaults add_generation_prompt to True
    return tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw
    )


def test_folder_looks_like_the_real_one(kimi_dir, kimi_tok):
    cfg = json.loads((kimi_dir / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k25" and cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    tc = cfg["text_config"]
    for key in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        assert tc[key] > 0
    assert tc["n_routed_experts"] > tc["num_experts_per_tok"] and tc["rope_scaling"]["type"] == "yarn"
    assert sorted(remote_code_files(kimi_dir)) == ["config.json", "tokenizer_config.json"]
    # a slow, tiktoken-based tokenizer: no offset mapping; Kimi's markers are single ids
    assert type(kimi_tok).__name__ == "TikTokenTokenizer" and not kimi_tok.is_fast
    assert len(kimi_tok) == tc["vocab_size"]
    for marker in ("<|im_end|>", "<|im_middle|>", "<think>", "</think>", "<|tool_calls_section_begin|>"):
        assert len(kimi_tok(marker, add_special_tokens=False)["input_ids"]) == 1
    text = "Hello 世界, 12345 tokens!\n<think>x</think>"
    assert kimi_tok.decode(kimi_tok(text, add_special_tokens=False)["input_ids"]) == text


def test_remote_code_needs_the_opt_in(kimi_dir):
    with pytest.raises(ConfigError, match=r"target.trust_remote_code: true"):
        load_tokenizer(kimi_dir, trust_remote_code=False, setting="target.trust_remote_code: true")
    assert TargetSpec(model="m").trust_remote_code is False  # never on by default


def test_worker_runtime_loads_the_tokenizer_only_with_the_opt_in(kimi_dir, settings):
    from schemas.mix import MixSpec

    def mix(trust: bool) -> MixSpec:
        return MixSpec.model_validate(
            {
                "name": "k",
                "target": {
                    "model": "kimi",
                    "api": "generate",
                    "tokenizer": str(kimi_dir),
                    "trust_remote_code": trust,
                },
                "sources": [{"name": "s", "format": "instruction", "path": "x.jsonl"}],
            }
        )

    # the mix asks, the worker allows: both are needed (a mix on the data root never grants it alone)
    rt = WorkerRuntime(
        settings, WorkerConfig(pool=PoolConfig(endpoints=["http://127.0.0.1:9"]), trust_remote_code=True)
    )
    try:
        with pytest.raises(ConfigError, match="trust_remote_code"):
            rt.tokenizer_for(mix(False))
        assert type(rt.tokenizer_for(mix(True))).__name__ == "TikTokenTokenizer"
    finally:
        rt.close()
    rt = WorkerRuntime(settings, WorkerConfig(pool=PoolConfig(endpoints=["http://127.0.0.1:9"])))
    try:
        with pytest.raises(ConfigError, match="--trust-remote-code"):
            rt.check_mix(mix(True), "mix.json")
        with pytest.raises(ConfigError, match="trust_remote_code"):
            rt.tokenizer_for(mix(True))
    finally:
        rt.close()


def test_template_thinking_tools_and_tool_results(kimi_tok):
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "call the tool", "tool_calls": [CALL]},
        {
            "role": "tool",
            "name": "get_weather",
            "tool_call_id": "functions.get_weather:0",
            "content": "sunny",
        },
    ]
    text = render(kimi_tok, msgs, tools=TOOLS, add_generation_prompt=True)
    # tools declared TypeScript-style first; no default system turn after them (K2.5, unlike K2)
    assert text.startswith(
        "<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {"
    )
    assert (
        'type get_weather = (_: {\n  // City name\n  city: string,\n  unit?: "celsius" | "fahrenheit"\n}) => any;'
        in text
    )
    assert "}) => any;\n}\n<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|>" in text
    assert "<|im_system|>system<|im_middle|>" not in text
    # up to the last assistant turn without tool calls: thinking dropped; the tool-call turn after it keeps it
    assert "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>" in text
    assert (
        "<think>call the tool</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        in text
    )
    assert (
        "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>" in text
    )
    assert text.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    off = render(kimi_tok, msgs, tools=TOOLS, add_generation_prompt=True, thinking=False)
    assert off.endswith("<think></think>") and "call the tool" not in off
    # once the task ends with a plain answer, every earlier turn loses its thinking
    done = render(kimi_tok, [*msgs, {"role": "assistant", "content": "Sunny.", "reasoning_content": "r"}])
    assert "call the tool" not in done and "<think></think>Sunny.<|im_end|>" in done


def test_generate_prompt_ids_on_the_slow_tokenizer(kimi_tok):
    history = [
        Message(role="user", content="hi"),
        Message(role="assistant", content="yo", reasoning_content="r"),
    ]
    history.append(Message(role="user", content="more"))
    ids = prompt_ids(kimi_tok, history, tuple(TOOLS), thinking=True)
    assert kimi_tok.decode(ids) == render(
        kimi_tok, [m.model_dump(exclude_none=True) for m in history], tools=TOOLS, add_generation_prompt=True
    )
    assert ids[-1] == kimi_tok.convert_tokens_to_ids("<think>")


def test_loss_mask_on_the_slow_tokenizer_covers_assistant_turns(kimi_tok):
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "tool", "tool_calls": [CALL]},
        {
            "role": "tool",
            "name": "get_weather",
            "tool_call_id": "functions.get_weather:0",
            "content": "sunny",
        },
    ]
    ex = ChatRenderer(kimi_tok).encode(msgs, TOOLS)
    ids, mask = ex.ids.tolist(), ex.mask.tolist()
    assert kimi_tok.decode(ids) == render(kimi_tok, msgs, tools=TOOLS)
    masked = kimi_tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert masked == (
        "</think>Hello!<|im_end|>tool</think><|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
    )


def _offset_mask(renderer: ChatRenderer, messages, tools) -> list[int]:
    """The mask as it was computed before (offset mappings), for fast tokenizers."""
    text = renderer._render(messages, tools=tools)
    enc = renderer.tok(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = renderer.spans(text, sum(1 for m in messages if m["role"] == "assistant"))
    return [int(any(s <= a < e for s, e in spans)) for a, _ in enc["offset_mapping"]]


def test_masks_on_the_fast_demo_tokenizer_are_unchanged():
    from transformers import AutoTokenizer

    from regen_service.train.fixtures import DEMO_TOKENIZER

    tok = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    r = ChatRenderer(tok)
    convs = [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there, friend."}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "add"},
            {"role": "user", "content": "and 3+3?"},
            {"role": "assistant", "content": "6", "reasoning_content": "add again"},
        ],
        [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Paris"}'}],
            },
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "Sunny in Paris."},
        ],
    ]
    for conv in convs:
        ex = r.encode(conv, TOOLS)
        assert ex.mask.tolist() == _offset_mask(r, conv, TOOLS)
        assert sum(ex.mask.tolist()) > 0


def test_validate_draft_and_launch_take_the_kimi_folder(kimi_dir, tmp_path, monkeypatch):
    import tests.draft.test_export_validate as ev

    tc = json.loads((kimi_dir / "config.json").read_text())["text_config"]
    monkeypatch.setattr(ev, "VOCAB", tc["vocab_size"])
    monkeypatch.setattr(ev, "LAYERS", tc["num_hidden_layers"])
    ev.make_checkpoint(tmp_path / "train")
    run = CliRunner().invoke
    res = run(
        main,
        [
            "export",
            str(tmp_path / "train"),
            "--out",
            str(tmp_path / "draft"),
            "--target-config",
            str(kimi_dir),
        ],
    )
    assert res.exit_code == 0, res.output
    res = run(main, ["validate-draft", str(tmp_path / "draft"), "--target-config", str(kimi_dir), "--json"])
    assert res.exit_code == 0, res.output
    res = run(
        main, ["launch-sglang", "--target", str(kimi_dir), "--draft", str(tmp_path / "draft"), "--print"]
    )
    assert res.exit_code == 0, res.output
    assert "--trust-remote-code" in res.output and "EAGLE3" in res.output


def test_train_refuses_remote_code_without_the_flag(kimi_dir, tmp_path, settings_env):
    res = CliRunner().invoke(
        main,
        ["train", "--run", "r", "--target", str(kimi_dir), "--out", str(tmp_path / "o"), "--device", "cpu"],
        env=settings_env,
    )
    assert res.exit_code != 0 and "--trust-remote-code" in res.output
    assert not (tmp_path / "o").exists()  # refused before any work


def test_enqueue_refuses_a_remote_code_tokenizer_without_the_opt_in(kimi_dir, tmp_path, settings_env):
    data = tmp_path / "p.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    mix = tmp_path / "mix.yaml"
    mix.write_text(
        "name: k\n"
        f"target: {{model: kimi, api: generate, tokenizer: {kimi_dir}}}\n"
        f"sources: [{{name: s, path: {data}, format: messages}}]\n"
    )
    res = CliRunner().invoke(main, ["enqueue", str(mix)], env=settings_env)
    assert res.exit_code != 0 and "target.trust_remote_code: true" in res.output
    assert not (Path(settings_env["REGEN_DATA_ROOT"]) / "runs").exists()  # nothing prepared


def test_a_template_whose_markers_split_a_token_is_a_clear_error(kimi_dir):
    tok = load_tokenizer(kimi_dir, trust_remote_code=True, setting="test")
    # the assistant header ends inside a word, so BPE merges across it: no exact mask possible
    tok.chat_template = (
        "{%- for m in messages -%}<|im_user|>{{ m['role'] }}<|im_middle|>"
        "{%- if m['role'] == 'assistant' -%}th{%- endif -%}{{ m['content'] }}<|im_end|>{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_user|>assistant<|im_middle|>th{%- endif -%}"
    )
    r = ChatRenderer(tok)
    with pytest.raises(ConfigError, match="token boundary"):
        r.encode([{"role": "user", "content": "q"}, {"role": "assistant", "content": "ink about it"}], None)
