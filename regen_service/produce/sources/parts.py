"""A message's content as text plus image parts, in order: what sharegpt and messages rows share.

Content is a string or a list of parts. Text parts are joined with no separator (as OpenAI-style
templates concatenate them); each image part becomes a schemas.media.ImageRef at the character offset
where it stood. An image part names its bytes itself (`image_url.url`, `image`), or takes the next
image of the row's `images` (or `image`) field: an `{"type": "image"}` part without a source, or an
`<image>` placeholder in string content (ShareGPT4V / LLaVA), which is removed from the text. Video
and audio parts are dropped and counted. Without a reader (a mix with no `images:` section) image
parts are dropped and counted too, and `<image>` stays text: what regen did before it read images. Loading and checking bytes is images.ImageReader's job;
storing them is the producer's.
"""

from __future__ import annotations

from typing import Any

from regen_service.produce.sources.base import Fields, RowError, check_text, type_name
from regen_service.produce.sources.images import ImageReader, LoadedImage
from schemas.media import ImageRef

PLACEHOLDER = "<image>"


class RowMedia:
    """The image parts of one row as they are read: the row's image list, and every image loaded."""

    def __init__(self, raw: dict, fields: Fields, reader: ImageReader | None):
        self.reader = reader
        self.loaded: dict[str, LoadedImage] = {}
        key = fields("images") if raw.get(fields("images")) is not None else fields("image")
        value = raw.get(key) if reader is not None else None
        self.key = key
        self.row_images: list = [] if value is None else value if isinstance(value, list) else [value]
        self.used = 0

    def _keep(self, image: LoadedImage) -> ImageRef:
        self.loaded.setdefault(image.ref.sha256, image)
        return image.ref

    def _reader(self, where: str) -> ImageReader:
        if self.reader is None:  # content_parts drops image parts without a reader; never reached
            raise RowError(f"{where}: image parts are not read here")
        return self.reader

    def named(self, value: Any, where: str) -> ImageRef:
        return self._keep(self._reader(where).load(value, where))

    def next_row_image(self, where: str) -> ImageRef:
        if self.used >= len(self.row_images):
            raise RowError(
                f"{where}: an image placeholder with no image left in `{self.key}` "
                f"({len(self.row_images)} given); the row's placeholders and images must match"
            )
        i = self.used
        self.used += 1
        return self._keep(self._reader(where).load(self.row_images[i], f"{self.key}[{i}]"))

    def finish(self) -> None:
        """Every image of the row's list was placed, or RowError: an unplaced image would be lost."""
        if self.used < len(self.row_images):
            raise RowError(
                f"{self.key}: {len(self.row_images)} images given but {self.used} placed (by {PLACEHOLDER} "
                "placeholders or image parts without a url); the row's placeholders and images must match"
            )


def _image_source(part: dict, kind: str, where: str) -> tuple[Any, str] | None:
    """What an image part names as its bytes, and the field path; None to take the row's next image."""
    if kind == "image_url":
        url = part.get("image_url")
        if isinstance(url, dict):
            return url.get("url"), f"{where}.image_url.url"
        return url, f"{where}.image_url"
    value = part.get("image")
    return (value, f"{where}.image") if value is not None else None


def content_parts(value: Any, where: str, media: RowMedia) -> tuple[str, int, tuple[ImageRef, ...]]:
    """Message content as (text, dropped non-image parts, image refs placed by offset)."""
    if value is None:
        return "", 0, ()
    if isinstance(value, str):
        text = check_text(value, where)
        if not media.row_images or PLACEHOLDER not in text:
            return text, 0, ()
        pieces = text.split(PLACEHOLDER)
        out, refs = pieces[0], []
        for piece in pieces[1:]:
            refs.append(media.next_row_image(where).model_copy(update={"offset": len(out)}))
            out += piece
        return out, 0, tuple(refs)
    if not isinstance(value, list):
        raise RowError(f"{where}: expected a string or a list of content parts, got {type_name(value)}")
    text, refs, dropped = "", [], 0
    for i, part in enumerate(value):
        at = f"{where}[{i}]"
        if isinstance(part, str):
            text += check_text(part, at)
            continue
        if not isinstance(part, dict):
            raise RowError(f"{at}: expected a content part object, got {type_name(part)}")
        kind = part.get("type", "text" if "text" in part else None)
        if kind == "text":
            text += check_text(part.get("text"), f"{at}.text")
        elif kind in ("image", "image_url") and media.reader is not None:
            source = _image_source(part, kind, at)
            ref = media.next_row_image(at) if source is None else media.named(*source)
            refs.append(ref.model_copy(update={"offset": len(text)}))
        else:
            dropped += 1
    if dropped and not text and not refs and media.reader is None:
        raise RowError(
            f"{where}: only non-text parts ({dropped} dropped: images/video); a text model cannot "
            "regenerate this turn; remove the row or add a text part"
        )
    if dropped and not text and not refs:
        raise RowError(
            f"{where}: only non-text parts ({dropped} dropped: video/audio); this turn cannot be "
            "regenerated from text and images; remove the row or add a text part"
        )
    return text, dropped, tuple(refs)
