"""Images in simulator requests: checked as a real server checks them, counted as image tokens.

A vision-language server decodes every image a request carries before it schedules anything, and
answers 400 for one it cannot read; so does the simulator, for the two shapes regen sends:
- chat: content parts `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`
  (vLLM's MediaConnector._load_data_url takes only base64 data URLs, as here; an http(s) or file URL
  would make the server fetch, which the simulator never does: 400);
- generate: `image_data`, one item per image (a data URL or bare base64, SGLang's load_image), as many
  as the prompt has image placeholders (`<|media_pad|>`, Kimi-K2.5's, SGLang's kimi_k25 processor).
Each image becomes ceil(width / image_token_px) * ceil(height / image_token_px) prompt tokens in place
of its placeholder (Kimi-K2.5's MoonViT: 14 px patches merged 2x2, so 28 px a token), so context
checks, prefill time and `prompt_tokens` account for images as the real engine's do.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
from dataclasses import dataclass

MEDIA_PAD = "<|media_pad|>"
# What Kimi-K2.5's chat template renders for an image part (kimi_fixture's chat_template.jinja).
IMAGE_TEXT = f"<|media_begin|>image<|media_content|>{MEDIA_PAD}<|media_end|>\n"


class BadImage(ValueError):
    """An image the request carries cannot be read; the message is the 400's."""


@dataclass(frozen=True)
class SimImage:
    sha256: str
    media_type: str
    width: int
    height: int
    num_bytes: int

    def tokens(self, token_px: int) -> int:
        return max(1, math.ceil(self.width / token_px) * math.ceil(self.height / token_px))


_FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp"}


def decode_image(value: object, where: str) -> SimImage:
    """A data URL or bare base64 string, decoded and identified; BadImage saying what is wrong."""
    if not isinstance(value, str) or not value:
        raise BadImage(f"{where}: an image must be a data URL or base64 string, got {type(value).__name__}")
    payload = value
    if value.startswith("data:"):
        head, sep, payload = value.partition(",")
        if not sep or not head.endswith(";base64"):
            raise BadImage(f"{where}: only base64 data URLs are supported (data:<type>;base64,<data>)")
    elif value.startswith(("http://", "https://", "file:")):
        raise BadImage(f"{where}: the simulator fetches no image URLs; send a base64 data URL")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise BadImage(f"{where}: invalid base64 image data ({e})") from None
    try:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as im:
            fmt, (width, height) = im.format, im.size
            im.load()
    except Exception as e:  # Pillow raises many types for bad bytes; any is the request's fault
        raise BadImage(f"{where}: cannot identify the image ({type(e).__name__}: {e})") from None
    if fmt not in _FORMATS:
        raise BadImage(f"{where}: unsupported image format {fmt}")
    return SimImage(hashlib.sha256(data).hexdigest(), _FORMATS[fmt], width, height, len(data))


def chat_images(messages: list[dict]) -> list[SimImage]:
    """Every image part of the chat messages, decoded, in order; BadImage for a bad one or an
    unknown part type (a text-only server would refuse an image part the same way)."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                continue
            if kind != "image_url":
                raise BadImage(f"{where}: unsupported content part type {kind!r} (text, image_url)")
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            out.append(decode_image(url, f"{where}.image_url.url"))
    return out


def generate_images(image_data: object) -> list[SimImage]:
    """SGLang's `image_data` for one request: one item or a list of them."""
    if image_data is None:
        return []
    items = image_data if isinstance(image_data, list) else [image_data]
    return [decode_image(v, f"image_data[{k}]") for k, v in enumerate(items)]


def extra_tokens(images: list[SimImage], token_px: int) -> int:
    """Prompt tokens the images add beyond their placeholders (one token each, already counted)."""
    return sum(im.tokens(token_px) - 1 for im in images)
