"""The Kimi fixture renders what Kimi-K2.5 renders, byte for byte, where K2.5 differs from K2.

Each expected string below was rendered from the real K2.5 template text, as published in
radixark/miles `miles/utils/chat_template_utils/templates/kimi_k25_fixed.jinja` @ 31f1ca96 (Moonshot's
template plus a `preserve_thinking` switch that is off by default, so the output is the original's),
through transformers' own `apply_chat_template` (5.24) on the fixture's tokenizer, with
`tools_ts_str` from an encoder held to PrimeIntellect-ai/renderers `renderers/kimi_k25.py` @ 00ef1bdc
(`_encode_tools_typescript`, "mirrors the upstream encoder shipped with the K2.5/K2.6 tokenizer").
The template text itself is not stored here: only its output (docs/kimi-k25.md lists the sources).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from regen_service.kimi_fixture import build_kimi_fixture
from regen_service.remote_code import load_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        },
    },
}
CALL = {
    "id": "functions.get_weather:0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
GEN = "<|im_assistant|>assistant<|im_middle|><think>"


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory) -> Path:
    return build_kimi_fixture(tmp_path_factory.mktemp("kimi25") / "Kimi-K2.5")


@pytest.fixture(scope="module")
def tok(kimi_dir):
    return load_tokenizer(kimi_dir, trust_remote_code=True, setting="test")


def render(tok, messages, *, gen: bool, **kw) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kw)


def test_no_default_system_turn(tok):
    # renderers tests/parity.py scenarios "generation-prompt-no-system" and "tools-without-system",
    # held to the real apply_chat_template for moonshotai/Kimi-K2.5; the miles template has no
    # default system branch (K2's "You are Kimi, ..." turn is gone).
    got = render(tok, [{"role": "user", "content": "Hi"}], gen=True)
    assert got == "<|im_user|>user<|im_middle|>Hi<|im_end|>" + GEN
    got = render(tok, [{"role": "user", "content": "Weather?"}], gen=False, tools=[WEATHER])
    assert got == (
        "<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n"
        "// Get the current weather for a city\ntype get_weather = (_: {\n  // The city name\n"
        "  city: string\n}) => any;\n}\n<|im_end|><|im_user|>user<|im_middle|>Weather?<|im_end|>"
    )
    assert "You are Kimi" not in got
    # a system turn the conversation has is rendered as given, once
    sys_msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render(tok, sys_msgs, gen=False) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>Hi<|im_end|>"
    )


def test_tool_message_without_tool_call_id_renders_an_empty_id(tok):
    # miles kimi_k25_fixed.jinja: `## Return of {{ tool_call_id }}` with `message.tool_call_id`
    # undefined renders empty; renderers kimi_k25.py `_render_tool_body` ("you get `## Return of \n`").
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny"},
    ]
    assert render(tok, msgs, gen=True) == (
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|><|im_assistant|>assistant<|im_middle|>"
        "<think></think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
        "<|im_end|><|im_system|>tool<|im_middle|>## Return of \nsunny<|im_end|>" + GEN
    )


def test_type_lists_render_as_typescript_unions(tok):
    # renderers kimi_k25.py `_UnionType` (["string", "null"] -> `string | null`), `_EnumType`
    # (null as JSON), `_TypedParam` (`// Default: ` + json.dumps), `_ScalarType` (minimum shown).
    search = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": ["string", "null"], "description": "Text to find, or null for all"},
                    "limit": {"type": "integer", "default": 10, "minimum": 1},
                    "kind": {"enum": ["note", "todo", None]},
                },
                "required": ["query"],
            },
        },
    }
    got = render(tok, [{"role": "user", "content": "Find milk"}], gen=True, tools=[search])
    assert got == (
        "<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {\n"
        "// Search the notes.\ntype search = (_: {\n  // Text to find, or null for all\n"
        '  query: string | null,\n  kind?: "note" | "todo" | null,\n  // minimum: 1\n  // Default: 10\n'
        "  limit?: number\n}) => any;\n}\n<|im_end|><|im_user|>user<|im_middle|>Find milk<|im_end|>" + GEN
    )


def test_a_schema_the_encoder_cannot_read_falls_back_to_compact_json(tok):
    # renderers kimi_k25.py `_parse_type` raises on a schema without type/enum/anyOf/$ref; the real
    # tokenizer then leaves tools_ts_str out and the miles template's `{{ tools | tojson(separators=
    # (',', ':')) }}` branch declares the (deep-sorted) tools as compact JSON.
    tag = {
        "type": "function",
        "function": {
            "name": "tag",
            "parameters": {
                "type": "object",
                "properties": {"label": {"description": "no type given"}},
                "required": ["label"],
            },
        },
    }
    got = render(tok, [{"role": "user", "content": "Tag it"}], gen=True, tools=[tag, WEATHER])
    assert got == (
        '<|im_system|>tool_declare<|im_middle|>[{"function":{"name":"tag","parameters":{"properties":'
        '{"label":{"description":"no type given"}},"required":["label"],"type":"object"}},'
        '"type":"function"},{"function":{"description":"Get the current weather for a city",'
        '"name":"get_weather","parameters":{"properties":{"city":{"description":"The city name",'
        '"type":"string"}},"required":["city"],"type":"object"}},"type":"function"}]<|im_end|>'
        "<|im_user|>user<|im_middle|>Tag it<|im_end|>" + GEN
    )


def test_media_tokens_are_named_and_image_parts_render(tok, kimi_dir):
    # Names and ids: transformers models/kimi_k25/configuration_kimi_k25.py @ 059101b2
    # (vision_start_token_id=163602, vision_end_token_id=163604, image_token_id=163605) and
    # processing_kimi_k25.py (image_token "<|media_pad|>", "<|media_begin|>video<|media_content|>");
    # 163584 is the first special id, so the offsets are 18..21.
    base = tok.convert_tokens_to_ids("[BOS]")
    names = ["<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"]
    assert [tok.convert_tokens_to_ids(n) for n in names] == [base + 18, base + 19, base + 20, base + 21]
    cfg = json.loads((kimi_dir / "config.json").read_text())
    assert cfg["media_placeholder_token_id"] == tok.convert_tokens_to_ids("<|media_pad|>")
    # miles kimi_k25_fixed.jinja `render_content`: image/image_url parts as the media block and a
    # newline, video/video_url as `<|kimi_k25_video_placeholder|>` and a newline, text as is;
    # renderers kimi_k25.py `emit_image` (one `<|media_pad|>` per image, trailing "\n").
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare "},
                {"type": "image_url", "image_url": {"url": "a.png"}},
                {"type": "image", "image": "b.png"},
                {"type": "video_url", "video_url": {"url": "c.mp4"}},
                {"type": "text", "text": "please."},
            ],
        }
    ]
    block = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\n"
    text = render(tok, msgs, gen=True)
    assert text == (
        f"<|im_user|>user<|im_middle|>Compare {block}{block}<|kimi_k25_video_placeholder|>\n"
        "please.<|im_end|>" + GEN
    )
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids.count(base + 21) == 2 and ids.count(base + 18) == 2  # one pad per image, as special ids
    assert tok.decode(ids, skip_special_tokens=True).count("image") == 2  # the markers are special


def test_a_prompt_with_stored_images_renders_as_the_real_template(tok, tmp_path):
    # A ShareGPT4V row through the real producer: the prompt shard's image parts, turned into OpenAI
    # parts by Message.to_dict("template"), render where the `<image>` placeholders stood, one media
    # block (and the template's newline) per image, as miles kimi_k25_fixed.jinja `render_content` does.
    import io

    import yaml
    from PIL import Image

    from regen_service.produce.prepare import prepare_run, run_id_for
    from regen_service.state.storage import RunLayout, Storage
    from schemas.mix import load_mix
    from schemas.prompt_rows import prompts_from_table

    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (9, 9, 9)).save(buf, "PNG")
    (tmp_path / "a.png").write_bytes(buf.getvalue())
    row = {
        "images": ["a.png", "a.png"],
        "conversations": [{"from": "human", "value": "<image>Left, <image>right?"}],
    }
    (tmp_path / "s.jsonl").write_text(json.dumps(row) + "\n")
    mix_file = tmp_path / "mix.yaml"
    mix_file.write_text(
        yaml.safe_dump(
            {"name": "vl", "target": {"model": "m"}, "images": {},
             "sources": [{"name": "s", "path": "s.jsonl", "format": "sharegpt"}]}
        )
    )  # fmt: skip
    mix = load_mix(mix_file)
    storage = Storage(str(tmp_path / "data"))
    manifest = prepare_run(mix, storage, run_id_for(mix), mix_file.read_text())
    layout = RunLayout(storage, manifest.run_id)
    (rec,) = prompts_from_table(storage.read_table(layout.prompt_shard(0)))
    msgs = [m.to_dict("template") for m in rec.conversation.messages]
    block = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>\n"
    assert (
        render(tok, msgs, gen=True)
        == f"<|im_user|>user<|im_middle|>{block}Left, {block}right?<|im_end|>" + GEN
    )
