"""Image parts of a conversation: the typed reference a message holds, and its Parquet column.

An image is stored once per content hash under the run (`runs/<run>/images/<sha256>.<ext>`, the path
owned by regen_service.state.storage.RunLayout.image_path) and a message refers to it by hash. Text
and images keep their order: a message's `content` is its text parts joined, and each `ImageRef`
says at which character of that text the image stands (`offset`), so the parts list the template
sees is rebuilt exactly (`content_parts`). Reading, checking and storing image bytes is the
producer's job (regen_service.produce.sources.images); this module only defines the shape.
pydantic and pyarrow only.
"""

from __future__ import annotations

import base64
from typing import Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

MediaType = Literal["image/png", "image/jpeg", "image/gif", "image/webp"]

# One extension per allowed type: the store's file names, and what a data URL says.
EXTENSIONS: dict[str, str] = {
    "image/png": "png",
    "image/jpeg": "jpg",
    "image/gif": "gif",
    "image/webp": "webp",
}
MEDIA_TYPES: dict[str, str] = {ext: media for media, ext in EXTENSIONS.items()}


def data_url(media_type: str, data: bytes) -> str:
    """`data:<type>;base64,<bytes>`: how an image travels inline in a request (the server reads no file of ours)."""
    return f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}"


class ImageRef(BaseModel):
    """One image part of a message: where it stands in the text, and which stored image it is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    offset: int = Field(ge=0, description="character offset in the message's content where the image stands")
    sha256: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="sha256 of the image bytes: its name in the store"
    )
    media_type: MediaType
    width: int = Field(ge=1)
    height: int = Field(ge=1)
    num_bytes: int = Field(ge=1)

    @property
    def file_name(self) -> str:
        """`<sha256>.<ext>`: the image's name in the run's image store."""
        return f"{self.sha256}.{EXTENSIONS[self.media_type]}"


def content_parts(text: str, images: tuple[ImageRef, ...]) -> list[dict]:
    """OpenAI-style content parts: text pieces and `image_url` parts in their original order.

    The url is the image's file name in the run's store (`images/<sha256>.<ext>`); a request replaces
    it with the bytes it sends. Chat templates render an image part without reading its url.
    """
    parts: list[dict] = []
    pos = 0
    for ref in sorted(images, key=lambda r: r.offset):
        if ref.offset > pos:
            parts.append({"type": "text", "text": text[pos : ref.offset]})
            pos = ref.offset
        parts.append({"type": "image_url", "image_url": {"url": f"images/{ref.file_name}"}})
    if pos < len(text) or not parts:
        parts.append({"type": "text", "text": text[pos:]})
    return parts


# A prompt shard's `images` column (only in shards that hold images: schemas.tables.PROMPT_SCHEMA_IMAGES).
IMAGE_PART = pa.struct(
    [
        ("message_index", pa.int32()),
        ("offset", pa.int64()),
        ("sha256", pa.string()),
        ("media_type", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("num_bytes", pa.int64()),
    ]
)


# Bounds on one image (mix `images:`). 20 MB is beyond any photo a VL prompt needs; the pixel bound is
# checked from the header before any decoding, so a small file that inflates to gigabytes (a
# decompression bomb) is refused without being decoded.
DEFAULT_MAX_IMAGE_BYTES = 20_000_000
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000


class ImagesSpec(BaseModel):
    """The mix's `images:` section: bounds on every image part, and whether remote URLs may be named."""

    model_config = ConfigDict(extra="forbid")

    max_image_bytes: int = Field(
        default=DEFAULT_MAX_IMAGE_BYTES, ge=1, description="a larger image is quarantined"
    )
    max_image_pixels: int = Field(
        default=DEFAULT_MAX_IMAGE_PIXELS, ge=1, description="width x height; a larger image is quarantined"
    )
    allow_remote: bool = Field(
        default=False,
        description="http(s) image URLs: refused unless true (regen fetches nothing from the network "
        "by default); when true, fetched by the producer within max_image_bytes and remote_timeout_s",
    )
    remote_timeout_s: float = Field(
        default=10.0, gt=0, le=600, description="connect and read timeout of one remote image fetch"
    )
