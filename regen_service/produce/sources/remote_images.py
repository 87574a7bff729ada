"""Fetching an http(s) image part, for a mix that allows it (`images: {allow_remote: true}`).

Only images.ImageReader calls this, and only when the mix's `images.allow_remote` is true; otherwise an
off-machine URL is refused there and nothing is fetched. A fetch is bounded the way a local file is:
a Content-Length above `max_image_bytes` is refused before the body is read, and a body without one is
read at most to the bound; the time is bounded by `remote_timeout_s` (connect and each read). Redirects
are followed by hand, at most `_MAX_REDIRECTS`, and only to http(s) URLs. Every failure (a status that
is not 200, a timeout, a refused connection, a body over the bound) is a RowError with its reason, so
the row is quarantined and the run goes on. What the bytes are is checked afterwards by ImageReader,
exactly as for a local file (magic bytes, pixel bound, full decode).
"""

from __future__ import annotations

from urllib.parse import urljoin

import httpx

from regen_service.produce.sources.base import RowError

_MAX_REDIRECTS = 3
_CHUNK = 1 << 16


def fetch_image(url: str, max_bytes: int, timeout_s: float, where: str) -> bytes:
    shown = repr(url[:200])
    with httpx.Client(timeout=timeout_s, follow_redirects=False) as client:
        for _ in range(_MAX_REDIRECTS + 1):
            try:
                with client.stream("GET", url) as resp:
                    if resp.is_redirect:
                        nxt = urljoin(url, resp.headers.get("location", ""))
                        if not nxt.lower().startswith(("http://", "https://")):
                            raise RowError(
                                f"{where}: image URL {shown} redirects to {nxt[:200]!r}; only http(s) is followed"
                            )
                        url = nxt
                        continue
                    if resp.status_code != 200:
                        raise RowError(f"{where}: image URL {shown} answered HTTP {resp.status_code}")
                    return _read_bounded(resp, max_bytes, where, shown)
            except httpx.HTTPError as err:
                raise RowError(
                    f"{where}: image URL {shown} could not be fetched ({type(err).__name__})"
                ) from None
    raise RowError(f"{where}: image URL {shown} redirects more than {_MAX_REDIRECTS} times")


def _read_bounded(resp: httpx.Response, max_bytes: int, where: str, shown: str) -> bytes:
    declared = resp.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise RowError(
            f"{where}: image too large ({declared} bytes > max_image_bytes {max_bytes}) at {shown}"
        )
    out = bytearray()
    for chunk in resp.iter_bytes(_CHUNK):
        out += chunk
        if len(out) > max_bytes:  # a server that sends more than it declared, or declared nothing
            raise RowError(f"{where}: image too large (more than max_image_bytes {max_bytes}) at {shown}")
    return bytes(out)
