"""Image inputs of chat requests: where an image may come from, how large it may be, and decoding
it without holding more than the limits allow.

An `image_url.url` may be:
- a `data:image/<png|jpeg|webp|gif>;base64,...` URL, or raw base64 (the format read from the bytes);
- a local file, as a path or a `file://` URL, only under the operator's `MLXQ_IMAGE_DIR`: the path is
  resolved (`..` and symlinks included) before it is checked to lie inside that directory;
- an `http(s)://` URL, only when the operator turns fetching on (`MLXQ_IMAGE_FETCH`), and then to
  public addresses only, within a byte limit, a deadline and a redirect limit (worker/image_fetch.py).
A local file is opened without following a symlink at any step below the directory and without
blocking, and read only if it is a regular file: a FIFO or a device is refused, never waited on.
The format is read from the bytes (PNG, JPEG, WebP, GIF: its first frame), the size from the header
before any pixel is decoded, and an image larger than the model's processor takes is scaled down to
that bound at once. Every refusal is an `ImageError` (a ValueError) whose message starts with the
request field and names the limit.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional
from urllib.parse import unquote, urlsplit

from schemas import RequestLimits
from worker.image_fetch import AddressPolicy, FetchRefused, fetch

# File signatures of the formats a request may send (WebP: "RIFF", a size, then "WEBP").
_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"))
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?)(?P<b64>;base64)?,", re.ASCII)
_MEDIA_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"}
_BASE64 = re.compile(rb"[A-Za-z0-9+/]+={0,2}")
_WHITESPACE = re.compile(rb"\s+")


class ImageError(ValueError):
    """An image the worker will not use; the message names the request field and the limit."""


@dataclass(frozen=True)
class ImagePolicy:
    """What a worker accepts (worker/settings.py fills it from MLXQ_* settings)."""

    max_bytes: int = RequestLimits.max_image_bytes  # MLXQ_MAX_IMAGE_BYTES: an image's encoded size, any source
    max_pixels: int = 40_000_000  # MLXQ_MAX_IMAGE_PIXELS: width x height, as the file's header declares
    image_dir: Optional[str] = None  # MLXQ_IMAGE_DIR: the one folder local paths may name
    fetch: bool = False  # MLXQ_IMAGE_FETCH: http(s) URLs are fetched only when this is on
    fetch_timeout_s: float = 10.0  # MLXQ_IMAGE_FETCH_TIMEOUT_S: the whole fetch, connect to last byte
    fetch_max_redirects: int = 3  # MLXQ_IMAGE_FETCH_MAX_REDIRECTS
    fetch_addresses: AddressPolicy = AddressPolicy()  # public ones, and MLXQ_IMAGE_FETCH_ALLOW_NETS


def load_image(url: str, field: str, policy: ImagePolicy, fit_pixels: Optional[int] = None,
               data: Optional[bytes] = None) -> Any:
    """The image `url` names (or its bytes, `data`, read already), decoded to RGB (a PIL image) and,
    when it has more than `fit_pixels` pixels, scaled down to about that many (the model's
    processor would scale it anyway)."""
    return decode_image(data if data is not None else image_bytes(url, field, policy), field, policy, fit_pixels)


def needs_io(url: str) -> bool:
    """Whether the image `url` names is read from a file or fetched (else it travels in the request)."""
    if url.startswith("data:"):
        return False
    if "://" in url:
        return urlsplit(url).scheme.lower() in ("http", "https", "file")
    compact = _WHITESPACE.sub(b"", url.encode("utf-8", "replace"))
    if len(compact) < 16 or len(compact) % 4 or not _BASE64.fullmatch(compact):
        return True
    if len(compact) > 256:
        return False  # base64 (bad base64 fails when it is decoded)
    try:
        return sniff_format(base64.b64decode(compact)) is None
    except (binascii.Error, ValueError):
        return True


def io_image_inputs(payload: object, max_images: int) -> list[tuple[str, str]]:
    """(field, url) of each image part of a raw chat request that is read from a file or fetched, in
    order, named as the request's fields are; none where the request has more than `max_images`
    image parts (its validation fails it, naming the limit, before anything is read)."""
    messages = payload.get("messages") if isinstance(payload, dict) else None
    found: list[tuple[str, str]] = []
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            image = part.get("image_url") if isinstance(part, dict) and part.get("type") == "image_url" else None
            url = image.get("url") if isinstance(image, dict) else None
            if isinstance(url, str):
                found.append((f"messages[{i}].content[{j}].image_url", url))
    if len(found) > max_images:
        return []
    return [(field, url) for field, url in found if needs_io(url)]


def image_bytes(url: str, field: str, policy: ImagePolicy, deadline: Optional[float] = None) -> bytes:
    """The encoded image `url` names, within `policy.max_bytes` (a fetch also by `deadline`, a
    time.monotonic() time)."""
    if url.startswith("data:"):
        return _data_url(url, field, policy)
    scheme = urlsplit(url).scheme.lower() if "://" in url else ""
    if scheme in ("http", "https"):
        return _fetch(url, field, policy, deadline)
    if scheme == "file":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ImageError(f"{field}: file:// URLs name this machine only, not {parts.netloc!r}")
        return _local_file(unquote(parts.path), field, policy)
    if scheme:
        raise ImageError(f"{field}: unsupported URL scheme {scheme!r}; send a data: URL, base64, "
                         "or a path under MLXQ_IMAGE_DIR")
    inline = _raw_base64(url, field, policy)
    return inline if inline is not None else _local_file(url, field, policy)


def _data_url(url: str, field: str, policy: ImagePolicy) -> bytes:
    head = _DATA_URL.match(url)
    if head is None:
        raise ImageError(f"{field}: malformed data: URL (expected data:image/<type>;base64,<data>)")
    media_type = (head.group("type") or "").lower()
    if media_type not in _MEDIA_TYPES:
        raise ImageError(f"{field}: unsupported image type {media_type or 'none'!r} in the data: URL "
                         f"(supported: {', '.join(f.lower() for f in FORMATS)})")
    if not head.group("b64"):
        raise ImageError(f"{field}: the data: URL must be base64 (data:{media_type};base64,...)")
    return _decode_base64(url[head.end():].encode("ascii", "replace"), field, policy)


def _raw_base64(text: str, field: str, policy: ImagePolicy) -> Optional[bytes]:
    """The bytes `text` encodes if it is base64 of an image, or too long to be a path; None if it
    may be a path (a short name of base64 characters that decodes to no image signature)."""
    compact = _WHITESPACE.sub(b"", text.encode("utf-8", "replace"))
    if len(compact) < 16 or len(compact) % 4 or not _BASE64.fullmatch(compact):
        return None
    data = _decode_base64(compact, field, policy)
    return data if sniff_format(data) is not None or len(compact) > 256 else None


def _decode_base64(encoded: bytes, field: str, policy: ImagePolicy) -> bytes:
    encoded = _WHITESPACE.sub(b"", encoded)
    if len(encoded) // 4 * 3 > policy.max_bytes + 2:
        raise ImageError(f"{field}: about {len(encoded) // 4 * 3} bytes of image exceed the limit of "
                         f"{policy.max_bytes} bytes (MLXQ_MAX_IMAGE_BYTES)")
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"{field}: invalid base64 ({exc})") from None
    _check_size(len(data), field, policy)
    return data


def _check_size(size: int, field: str, policy: ImagePolicy) -> None:
    if size > policy.max_bytes:
        raise ImageError(f"{field}: {size} bytes of image exceed the limit of {policy.max_bytes} bytes "
                         "(MLXQ_MAX_IMAGE_BYTES)")


def _local_file(path_text: str, field: str, policy: ImagePolicy) -> bytes:
    if not policy.image_dir:
        raise ImageError(f"{field}: not a data: URL or base64 image, and local image files are off on this "
                         "worker (MLXQ_IMAGE_DIR is not set)")
    base = Path(policy.image_dir).resolve()
    # An absolute path replaces `base`; resolving follows every symlink and `..` before the check, and
    # the check comes before any question of existence, so nothing outside is revealed.
    try:
        target = (base / path_text).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop, a NUL byte
        raise ImageError(f"{field}: {path_text!r} does not name a file: {exc}") from None
    if not target.is_relative_to(base) or target == base:
        raise ImageError(f"{field}: {path_text!r} is outside the image directory (MLXQ_IMAGE_DIR); only "
                         "files under it may be named")
    fd = _open_regular(base, target.relative_to(base).parts, path_text, field)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ImageError(f"{field}: {path_text!r} is not a regular file")
        _check_size(info.st_size, field, policy)
        chunks, size = [], 0
        while size <= policy.max_bytes:  # a file that grows while read still stops at the limit
            chunk = os.read(fd, policy.max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    _check_size(size, field, policy)
    return b"".join(chunks)


_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _open_regular(base: Path, parts: tuple[str, ...], path_text: str, field: str) -> int:
    """Open the file at `parts` under `base`, one directory at a time, following no symlink (one
    swapped in after the path was resolved is refused, not followed), and only if it is a regular
    file: stat first, then open without blocking (opening a FIFO would wait for a writer), so a FIFO
    or a device is refused, never opened for reading."""
    try:
        directory = os.open(base, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        try:
            for part in parts[:-1]:
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC, dir_fd=directory)
                os.close(directory)
                directory = inner
            if not stat.S_ISREG(os.stat(parts[-1], dir_fd=directory, follow_symlinks=False).st_mode):
                raise ImageError(f"{field}: {path_text!r} is not a regular file")
            return os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | _CLOEXEC,
                           dir_fd=directory)
        finally:
            os.close(directory)
    except OSError as exc:
        raise ImageError(f"{field}: cannot open {path_text!r} under the image directory: "
                         f"{exc.strerror or exc}") from None


def _fetch(url: str, field: str, policy: ImagePolicy, deadline: Optional[float] = None) -> bytes:
    if not policy.fetch:
        raise ImageError(f"{field}: this worker does not fetch http(s) URLs (MLXQ_IMAGE_FETCH is off); "
                         "send the image inline as a data: URL")
    try:
        return fetch(url, max_bytes=policy.max_bytes, timeout_s=policy.fetch_timeout_s,
                     max_redirects=policy.fetch_max_redirects, policy=policy.fetch_addresses, deadline=deadline)
    except FetchRefused as exc:
        raise ImageError(f"{field}: {exc}") from None


def sniff_format(data: bytes) -> Optional[str]:
    """PNG, JPEG, WEBP or GIF, from the file signature; None for anything else."""
    for signature, name in _SIGNATURES:
        if data.startswith(signature):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def decode_image(data: bytes, field: str, policy: ImagePolicy, fit_pixels: Optional[int] = None) -> Any:
    from PIL import Image, ImageOps

    kind = sniff_format(data)
    if kind is None:
        raise ImageError(f"{field}: unsupported image format (supported: {', '.join(f.lower() for f in FORMATS)})")
    try:
        image = Image.open(io.BytesIO(data), formats=[kind])
    except Image.DecompressionBombError as exc:  # Pillow's own limit, checked as it opens
        raise ImageError(f"{field}: the image declares more pixels than the limit of {policy.max_pixels} "
                         f"(MLXQ_MAX_IMAGE_PIXELS): {exc}") from None
    except Exception as exc:
        raise ImageError(f"{field}: could not read the {kind} image: {exc}") from None
    width, height = image.size
    if width * height > policy.max_pixels:
        raise ImageError(f"{field}: {width}x{height} = {width * height} pixels exceed the limit of "
                         f"{policy.max_pixels} (MLXQ_MAX_IMAGE_PIXELS)")
    target = _fitted(width, height, fit_pixels)
    try:
        if target != (width, height) and kind == "JPEG":
            image.draft("RGB", target)  # JPEG decodes at 1/2, 1/4 or 1/8 scale: less memory from the start
        rgb = image.convert("RGB")  # decodes; a GIF's or WebP's first frame
        if rgb.size != target:
            rgb = rgb.resize(target, Image.Resampling.BICUBIC)
        return ImageOps.exif_transpose(rgb) if kind in ("JPEG", "WEBP") else rgb
    except Exception as exc:  # truncated or corrupt data: Pillow raises OSError, SyntaxError, ValueError...
        raise ImageError(f"{field}: could not decode the {kind} image: {exc}") from None


def _fitted(width: int, height: int, fit_pixels: Optional[int]) -> tuple[int, int]:
    if not fit_pixels or width * height <= fit_pixels:
        return width, height
    scale = math.sqrt(fit_pixels / (width * height))
    return max(1, int(width * scale)), max(1, int(height * scale))
