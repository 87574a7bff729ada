"""Training samples whose context holds images: what the engine must be sent, and how its states line up.

A row with image parts (the output shard's `images` column, OUTPUT_SCHEMA_IMAGES: message index,
character offset, stored image, put back on its messages by schemas.rows.output_rows) is rendered by the trainer's chat template as any
other row: each image part becomes the template's media block with ONE placeholder token (Kimi-K2.5:
`<|media_pad|>`). The target saw more: its processor expands that placeholder to one token per merged
image patch, and those positions carry the image's embeddings. So such a sample keeps a `VlContext`
(the messages in the template form, the stored images they name, the template switches), the engine
backend sends the conversation with the images through the engine's chat API, and `align` maps the
engine's expanded token ids back onto the sample: the draft's input ids become the engine's (the
placeholder repeated, what the target saw), and the loss mask is 0 on every image token. The HF backend
cannot put images in the prompt; loop.py refuses such rows with it. Everything here is plain data, so
a held-out sample keeps its context in the checkpoint (eval_set.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from regen_service.errors import ConfigError
from schemas.media import MEDIA_TYPES, data_url

IMAGE_URL_PREFIX = "images/"  # schemas.media.content_parts names a stored image so


@dataclass(frozen=True)
class VlContext:
    messages: str  # JSON: the sample's messages in the template form (image urls name stored images)
    images: tuple[str, ...]  # storage path of each image part, in the order the parts appear
    template_kwargs: str = "{}"  # JSON: chat-template switches the sample was rendered with (thinking)

    def as_dict(self) -> dict:
        return {
            "messages": self.messages,
            "images": list(self.images),
            "template_kwargs": self.template_kwargs,
        }

    @classmethod
    def from_dict(cls, d: dict | None) -> VlContext | None:
        if not d:
            return None
        return cls(d["messages"], tuple(d["images"]), d.get("template_kwargs", "{}"))


def _image_parts(messages: list[dict]) -> Iterator[dict]:
    """The messages' image_url parts, in order (text-only contents have none)."""
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            yield from (part for part in content if part.get("type") == "image_url")


def image_names(messages: list[dict]) -> list[str]:
    """The stored image file names the messages' image parts name, in order."""
    names = []
    for part in _image_parts(messages):
        url = part["image_url"]["url"]
        if not url.startswith(IMAGE_URL_PREFIX):
            raise ConfigError(f"image part {url[:80]!r} names no stored image (images/<sha256>.<ext>)")
        names.append(url.removeprefix(IMAGE_URL_PREFIX))
    return names


def context_for(
    messages: list[dict], image_path: Callable[[str], str], **template_kwargs
) -> VlContext | None:
    """The VlContext of a sample rendered from `messages`; None when they hold no image."""
    names = image_names(messages)
    if not names:
        return None
    return VlContext(json.dumps(messages), tuple(image_path(n) for n in names), json.dumps(template_kwargs))


def request_messages(ctx: VlContext, read: Callable[[str], bytes]) -> list[dict]:
    """The messages as the engine's chat API takes them: each stored image sent inline as a data URL
    (the engine reads no file of ours), once per image part."""
    messages = json.loads(ctx.messages)
    for part, path in zip(_image_parts(messages), ctx.images, strict=True):
        part["image_url"] = {"url": data_url(MEDIA_TYPES[path.rsplit(".", 1)[-1]], read(path))}
    return messages


def align(
    engine_ids: list[int], ids: list[int], mask: list[int], image_token_id: int
) -> tuple[list[int], list[int]]:
    """(ids, mask) of the sample on the engine's expanded sequence: every token of `ids` in order, each
    image placeholder widened to the engine's run of it (mask 0 there), cut where `ids` ends (a sample
    cut at max_length stays cut). A mismatch means the engine rendered another text than the trainer's
    template: the states would belong to another sequence, so it is refused."""
    out_ids: list[int] = []
    out_mask: list[int] = []
    i = 0
    for j, tok in enumerate(ids):
        if i >= len(engine_ids) or engine_ids[i] != tok:
            got = engine_ids[i] if i < len(engine_ids) else "the end"
            raise ConfigError(
                f"the engine's prompt differs from the trainer's rendering at token {j} (trainer {tok}, engine "
                f"{got}): serve the same tokenizer and chat template as --target, with the images' placeholder "
                f"token id {image_token_id}"
            )
        run = 1
        if tok == image_token_id:
            while i + run < len(engine_ids) and engine_ids[i + run] == image_token_id:
                run += 1
        out_ids += engine_ids[i : i + run]
        out_mask += [0] * run if tok == image_token_id else [mask[j]]
        i += run
    return out_ids, out_mask
