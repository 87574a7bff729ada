"""A tiny Kimi-K2.5 (vision-language) target built locally (no download), for CPU tests of image data.

`make_tiny_vl_target` saves a small random `Kimi_K25ForConditionalGeneration` (transformers' own
classes: a 2-layer MoonViT vision tower, its patch-merger projector, and a 4-layer DeepSeek-V3 text
model with MLA attention), the demo tokenizer with `<|media_begin|>` added and a chat template that
renders image parts as Kimi-K2.5's does, and the `media_proc_cfg` preprocessor config vLLM's Kimi-K2.5
image processor reads. `draw_image` draws a deterministic picture.

Why Kimi-K2.5 itself: vLLM's `extract_hidden_states` method (the trainer's engine backend) needs a model
with `SupportsEagle3`; of the multimodal ones that have it in vLLM 0.32 (llava.py, qwen2_5_vl.py,
qwen3_vl.py, mistral3.py, gemma4_mm.py, kimi_k25.py, ...) every one but kimi_k25.py imports torchvision
at module load (through pixtral.py or qwen2_vl.py), which the engine environment leaves out on purpose
(the registry's torchvision does not match the CPU torch: Makefile). kimi_k25.py preprocesses images
with its own numpy/numba processor (transformers_utils/processors/kimi_k25_vision_fused.py) and its MLA
runs on the CPU backend (v1/attention/backends/mla/cpu_mla.py: latent 512 + rope 64, hence
kv_lora_rank 512 and qk_rope_head_dim 64 here). So the tests run the target the issue is about, and
an image becomes a variable number of `<|media_pad|>` tokens (one per 2x2 merged 14-pixel patches,
padded: a 64x48 picture gives 3x2 = 6), as for the real model.

transformers (5.24) saves this model under names of its own making for the text model (`blocks`,
`self_wqkv`); the file is rewritten under the names of Moonshot's checkpoint, which vLLM loads
(model_executor/models/kimi_k25.py `hf_to_vllm_mapper`, kimi_k25_vit.py).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from regen_service.train.fixtures import DEMO_TOKENIZER, random_scaled

IMAGE_TOKEN = "<|media_pad|>"
MEDIA_BEGIN = "<|media_begin|>"
# Kimi-K2.5's own block for one image part, newline included (docs/kimi-k25.md; tests/test_kimi_fixture_k25.py)
IMAGE_BLOCK = MEDIA_BEGIN + "image<|media_content|>" + IMAGE_TOKEN + "<|media_end|>\n"
PATCH = 14
ARCH = "KimiK25ForConditionalGeneration"  # the name in Moonshot's config.json and vLLM's registry
# Kimi-K2.5's media_proc_cfg with the limits cut to the tiny vision tower (its position table is 16x16
# patches): at most 64 patches, 16 merged tokens, per image.
MEDIA_PROC_CFG = {
    "patch_size": PATCH, "merge_kernel_size": [2, 2], "in_patch_limit": 64, "patch_limit_on_one_side": 16,
    "fixed_output_tokens": None, "temporal_merge_kernel_size": 4, "in_patch_limit_each_frame": 64,
    "in_patch_limit_video": None, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}  # fmt: skip

# The demo template, with image parts rendered where a message's content is a list of parts (the
# "template" form of schemas.conversation.Message). The parts are looped over `m['content']` itself,
# which is how vLLM detects a template that takes OpenAI-style content lists (no "string" flattening).
_PARTS = (
    "{%- if m['content'] is string or m['content'] is none -%}{{ m['content'] or '' }}"
    "{%- else -%}{%- for p in m['content'] -%}"
    "{%- if p['type'] == 'text' -%}{{ p['text'] }}"
    "{%- elif p['type'] in ('image', 'image_url') -%}" + IMAGE_BLOCK.replace("\n", "{{ '\\n' }}") + ""
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
)


def vl_chat_template() -> str:
    text = (DEMO_TOKENIZER / "chat_template.jinja").read_text()
    # user and system messages carry images; the demo template renders both as `{{ m['content'] or '' }}`
    return text.replace("{{ m['content'] or '' }}", _PARTS)


def _checkpoint_name(name: str) -> str:
    """transformers' saved name -> the name in Moonshot's checkpoint (what vLLM's loader maps)."""
    name = name.replace("language_model.model.blocks.", "language_model.model.layers.")
    name = name.replace(".self_wqkv.", ".self_attn.q_proj.")
    name = name.replace("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed.")
    return name.removeprefix("model.")  # model.mm_projector.pre_norm


def make_tiny_vl_target(
    path: str | Path, layers: int = 4, hidden: int = 128, heads: int = 2, seed: int = 0,
    embed_scale: float = 10.0, logit_scale: float = 30.0,
) -> Path:  # fmt: skip
    """embed_scale and logit_scale as make_tiny_target's (fixtures.py says what each does and what was
    measured). embed_scale defaults to 10 here: at 1 this random MLA model's greedy answer is one token
    repeated whatever the prompt (2 distinct ids in 16, measured), which a draft learns from the first
    step; at 10 the next token follows the current one (16 distinct in 16), a structure to learn."""
    from transformers import AutoTokenizer, Kimi_K25Config
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

    path = Path(path)
    tok = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    tok.add_tokens([MEDIA_BEGIN], special_tokens=True)  # the demo vocabulary spells it <|media_start|>
    tok.chat_template = vl_chat_template()
    text = dict(
        model_type="deepseek_v3", vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        first_k_dense_replace=layers, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=hidden // 2, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, head_dim=64, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, patch_size=PATCH,
        merge_kernel_size=[2, 2], pos_emb_height=16, pos_emb_width=16, pos_emb_time=4,
    )  # fmt: skip
    config = Kimi_K25Config(
        text_config=text, vision_config=vision, projection_hidden_size=32, tie_word_embeddings=False,
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_start_token_id=tok.convert_tokens_to_ids(MEDIA_BEGIN),
        vision_end_token_id=tok.convert_tokens_to_ids("<|media_end|>"),
    )  # fmt: skip
    random_scaled(Kimi_K25ForConditionalGeneration, config, seed, embed_scale, logit_scale).save_pretrained(
        path
    )
    weights = path / "model.safetensors"
    save_file({_checkpoint_name(k): v.contiguous() for k, v in load_file(str(weights)).items()}, str(weights))
    # vLLM registers Moonshot's class name; transformers' own (`Kimi_K25...`) would send vLLM to its
    # generic Transformers backend, whose processor needs torchvision. `use_unified_vision_chunk` (in
    # Moonshot's config.json) makes vLLM's chat parser hand images to the model as its "vision_chunk"
    # items (renderers/chat_utils.py); without it every image is refused ("at most 0 images").
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(architectures=[ARCH], use_unified_vision_chunk=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    tok.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}, indent=1))
    return path


def draw_image(seed: int, size: tuple[int, int] = (64, 48), fmt: str = "PNG") -> bytes:
    """A deterministic picture (a colour gradient with a seeded block), as image file bytes."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    x = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, h, dtype=np.float32)[:, None, None]
    base = rng.uniform(0, 1, size=3).astype(np.float32)
    arr = (x * base + y * (1 - base)).clip(0, 255).astype(np.uint8)
    bx, by = int(rng.integers(0, w // 2)), int(rng.integers(0, h // 2))
    arr[by : by + h // 3, bx : bx + w // 3] = rng.integers(0, 256, size=3, dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format=fmt)
    return buf.getvalue()
