"""A prompt's images, read from the run's image store and put into the request the target answers.

The producer stored each image once, under its content hash (runs/<run>/images/<sha256>.<ext>,
RunLayout.image_path); a prompt holds only references (schemas.media.ImageRef). Per row, `RunImages`
reads the bytes of every image the conversation names through the Storage abstraction (local, NFS or
an object store alike), checks that they still hash to their name, and turns them into data URLs,
once per row: every turn of a `turns: all` row sends the same images, so they are read once and each
request carries them inline (servers read nothing from regen's data root).

The two request shapes (sources cited in docs/sources.md, "Requests with images"):
- chat (`/v1/chat/completions`, vLLM and SGLang): the message's content becomes OpenAI parts in text
  order, each image an `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`
  (`chat_messages`);
- generate (SGLang's native `/generate`): `image_data`, one data URL per image in the order the
  rendered prompt holds their placeholders (`image_data`): messages in order, by offset within each.

A request whose images exceed `max_request_image_bytes` (raw bytes, summed over the image parts it
carries) fails its row with RequestImagesTooLargeError; a missing or altered store file with
ImageUnavailableError. Both are terminal row errors: retrying cannot make the bytes appear.
"""

from __future__ import annotations

import asyncio
import hashlib

from regen_service.errors import ImageUnavailableError, RequestImagesTooLargeError
from regen_service.state.storage import RunLayout
from schemas.conversation import Message
from schemas.media import ImageRef, content_parts, data_url


def _ordered(m: Message) -> list[ImageRef]:
    # content_parts places images by offset (a stable sort): the same order here.
    return sorted(m.images or (), key=lambda r: r.offset)


def images_of(messages: list[Message] | tuple[Message, ...]) -> list[ImageRef]:
    """Every image part of the messages, in the order a rendered prompt holds them."""
    return [ref for m in messages for ref in _ordered(m)]


class RunImages:
    """Reads a run's stored images for requests, bounded per request (one per Regenerator)."""

    def __init__(self, layout: RunLayout, max_request_image_bytes: int) -> None:
        self.layout = layout
        self.max_request_image_bytes = max_request_image_bytes

    def check_bound(self, refs: list[ImageRef]) -> None:
        """RequestImagesTooLargeError when one request would carry more image bytes than allowed.
        Checked from the refs' sizes before anything is read: an over-bound row costs no I/O."""
        total = sum(r.num_bytes for r in refs)
        if total > self.max_request_image_bytes:
            raise RequestImagesTooLargeError(
                f"the request would carry {len(refs)} image part(s) of {total} bytes in all, more than the "
                f"worker's max_request_image_bytes {self.max_request_image_bytes} (`regen worker "
                "--max-request-image-bytes`); raise it if the endpoints accept such requests"
            )

    def _read(self, ref: ImageRef) -> bytes:
        path = self.layout.image_path(ref.file_name)
        try:
            data = self.layout.storage.read_bytes(path)
        except FileNotFoundError:
            raise ImageUnavailableError(
                f"image {ref.file_name} is missing from the run's image store ({path}); the store lost a "
                "file the prompt names: enqueue the mix again (--redo) to store its images"
            ) from None
        if hashlib.sha256(data).hexdigest() != ref.sha256:
            raise ImageUnavailableError(
                f"image {ref.file_name} in the run's image store ({path}) no longer hashes to its name "
                f"({len(data)} bytes): it was changed after enqueue, so the prompt's image is gone; "
                "enqueue the mix again (--redo)"
            )
        return data

    def _load_sync(self, refs: list[ImageRef]) -> dict[str, str]:
        urls: dict[str, str] = {}
        for ref in refs:
            if ref.sha256 not in urls:
                data = self._read(ref)
                urls[ref.sha256] = data_url(ref.media_type, data)
        return urls

    async def load(self, messages: list[Message] | tuple[Message, ...]) -> dict[str, str]:
        """sha256 -> data URL for every image the messages name (read once each, off the event loop:
        an object store read would stall every request and the lease heartbeat)."""
        refs = images_of(messages)
        if not refs:
            return {}
        self.check_bound(refs)
        return await asyncio.to_thread(self._load_sync, refs)


def chat_messages(history: list[Message], urls: dict[str, str]) -> list[dict]:
    """The chat request's messages: the "template" form, image parts' urls replaced by data URLs."""
    out = []
    for m in history:
        if not m.images:
            out.append(m.to_dict("template"))
            continue
        d = m.to_dict("template")
        refs = iter(_ordered(m))
        d["content"] = [
            {"type": "image_url", "image_url": {"url": urls[next(refs).sha256]}}
            if p["type"] == "image_url"
            else p
            for p in content_parts(m.content, m.images)
        ]
        out.append(d)
    return out


def image_data(history: list[Message], urls: dict[str, str]) -> list[str]:
    """SGLang `/generate`'s `image_data`: one data URL per image placeholder, in prompt order."""
    return [urls[ref.sha256] for ref in images_of(history)]
