"""Image parts of a row: where their bytes come from, and the checks an image passes before it is kept.

An image part names its bytes in one of four ways: a data URL (`data:image/png;base64,...`), a local
path (relative to the source file's folder, or absolute), a Hugging Face `Image` value (a dict with
`bytes` and/or `path`), or raw bytes. `ImageReader.load` reads them and checks them in order:
off-machine URLs are refused unless the mix allows them (then remote_images.py fetches them, bounded),
then size (`max_image_bytes`), then the magic
bytes (PNG, JPEG, GIF, WEBP only: SVG and anything else that could carry active content are refused),
then the pixel count from the header (`max_image_pixels`, before any decoding: a decompression bomb is
never inflated), then a full decode by Pillow. Any failure is a RowError with the reason, so the row
is quarantined. Storing the bytes (once per hash) is the producer's job; placing the parts in the
text is the normalizers' (base.content_parts).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from pathlib import Path
from typing import Any, NamedTuple

from regen_service.produce.sources.base import RowError, type_name
from regen_service.produce.sources.remote_images import fetch_image
from schemas.media import ImageRef, ImagesSpec

# Magic bytes of the allowed types; WEBP is RIFF....WEBP.
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)
_PIL_FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp"}


class LoadedImage(NamedTuple):
    """A checked image: its reference (offset 0; the caller places it) and the bytes to store."""

    ref: ImageRef
    data: bytes


def sniff(data: bytes) -> str | None:
    """The media type the magic bytes say, or None for anything not allowed."""
    for magic, kind in _MAGIC:
        if data.startswith(magic):
            return kind
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def _what_it_is(data: bytes) -> str:
    head = data[:256].lstrip().lower()
    if head.startswith((b"<svg", b"<?xml")) or b"<svg" in head:
        return "an SVG (XML that can carry scripts and external references)"
    if head.startswith((b"<!doctype", b"<html", b"<")):
        return "markup (HTML/XML)"
    if head.startswith(b"%pdf"):
        return "a PDF"
    return f"unknown content (starts with {data[:8]!r})"


class ImageReader:
    """Loads and checks the image parts of one source's rows; `base_dir` is the source file's folder."""

    def __init__(self, spec: ImagesSpec, base_dir: str | None):
        self.spec = spec
        self.base_dir = base_dir

    def load(self, value: Any, where: str) -> LoadedImage:
        data = self._bytes(value, where)
        return self.check(data, where)

    def _bytes(self, value: Any, where: str) -> bytes:
        if isinstance(value, bytes | bytearray):
            return bytes(value)
        if isinstance(value, dict):  # a Hugging Face Image value: bytes win, else the path
            if value.get("bytes") is not None:
                return self._bytes(value["bytes"], f"{where}.bytes")
            if value.get("path"):
                return self._bytes(value["path"], f"{where}.path")
            raise RowError(f"{where}: an image object with neither bytes nor path")
        if not isinstance(value, str) or not value:
            raise RowError(
                f"{where}: expected an image (data URL, path, or {{bytes, path}}), got {type_name(value)}"
            )
        lower = value[:16].lower()
        if lower.startswith("data:"):
            return self._data_url(value, where)
        if lower.startswith(("http://", "https://")):
            if not self.spec.allow_remote:
                raise RowError(
                    f"{where}: image URL {value[:200]!r} points off the machine; refused (regen fetches "
                    "nothing from the network); store the image with the dataset and name its path"
                )
            return fetch_image(value, self.spec.max_image_bytes, self.spec.remote_timeout_s, where)
        if "://" in value[:32]:
            raise RowError(
                f"{where}: image URL scheme of {value[:200]!r} is not supported (data: URLs and paths only)"
            )
        return self._file(value, where)

    def _data_url(self, value: str, where: str) -> bytes:
        header, sep, payload = value.partition(",")
        if not sep or ";base64" not in header.lower():
            raise RowError(
                f"{where}: a data URL must be base64 (data:image/...;base64,...), got {header[:60]!r}"
            )
        # base64 is 4/3 of the bytes: refuse an oversized image before decoding it
        if len(payload) * 3 // 4 > self.spec.max_image_bytes + 3:
            raise RowError(self._too_large(len(payload) * 3 // 4, where))
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as err:
            raise RowError(f"{where}: data URL is not valid base64 ({err})") from None

    def _file(self, value: str, where: str) -> bytes:
        path = Path(value)
        if not path.is_absolute() and self.base_dir is not None:
            path = Path(self.base_dir) / path
        try:
            size = path.stat().st_size
            if size > self.spec.max_image_bytes:  # refused before it is read
                raise RowError(self._too_large(size, where))
            return path.read_bytes()
        except OSError as err:
            raise RowError(f"{where}: image file {value[:200]!r} cannot be read ({err.strerror})") from None

    def _too_large(self, size: int, where: str) -> str:
        return f"{where}: image too large ({size} bytes > max_image_bytes {self.spec.max_image_bytes})"

    def check(self, data: bytes, where: str) -> LoadedImage:
        if len(data) > self.spec.max_image_bytes:
            raise RowError(self._too_large(len(data), where))
        kind = sniff(data)
        if kind is None:
            raise RowError(
                f"{where}: not a PNG, JPEG, GIF or WEBP image: {_what_it_is(data)}; only those four are "
                "accepted (SVG and other active content are refused)"
            )
        width, height = self._decode(data, kind, where)
        ref = ImageRef(
            offset=0,
            sha256=hashlib.sha256(data).hexdigest(),
            media_type=kind,
            width=width,
            height=height,
            num_bytes=len(data),
        )
        return LoadedImage(ref, data)

    def _decode(self, data: bytes, kind: str, where: str) -> tuple[int, int]:
        from PIL import Image

        limit = self.spec.max_image_pixels
        try:
            with warnings.catch_warnings():
                # our own bound applies; Pillow's bomb warning would only repeat it
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(data)) as img:
                    width, height = img.size
                    if width * height > limit:
                        raise RowError(
                            f"{where}: image too large ({width} x {height} = {width * height} pixels > "
                            f"max_image_pixels {limit})"
                        )
                    if _PIL_FORMATS.get(img.format) != kind:
                        raise RowError(
                            f"{where}: unreadable image (magic bytes say {kind}, Pillow reads {img.format})"
                        )
                    img.load()  # a full decode: truncated or corrupt data fails here
        except RowError:
            raise
        except Image.UnidentifiedImageError:  # its message names a BytesIO object: no use in a reason
            raise RowError(
                f"{where}: unreadable image (Pillow cannot identify it: a corrupt or truncated header)"
            ) from None
        except Image.DecompressionBombError as err:
            raise RowError(f"{where}: image too large ({err}; max_image_pixels {limit})") from None
        except Exception as err:  # Pillow raises many types (OSError, SyntaxError, ValueError, ...)
            raise RowError(f"{where}: unreadable image ({type(err).__name__}: {str(err)[:200]})") from None
        if width < 1 or height < 1:
            raise RowError(f"{where}: unreadable image (size {width} x {height})")
        return width, height
