"""Images and image requests for the tests, made in code."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image


def encoded(fmt: str, size: tuple[int, int] = (24, 16), color: tuple[int, int, int] = (200, 40, 90)) -> bytes:
    """A plain `size` (width, height) image of one colour, in `fmt`."""
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, fmt)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def noise(seed: int, size: tuple[int, int] = (56, 84), fmt: str = "PNG") -> bytes:
    """A noise image (width, height), different for each seed."""
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8")).save(out, fmt)
    return out.getvalue()


def picture(seed: int, size: tuple[int, int] = (56, 84), fmt: str = "PNG") -> str:
    """A data URL of `noise(seed, size, fmt)`."""
    return data_url(noise(seed, size, fmt), f"image/{fmt.lower()}")


def png_declaring(width: int, height: int) -> bytes:
    """A valid small PNG whose header says width x height (the pixel data is for 1 x 1)."""
    raw = encoded("PNG", (1, 1))
    chunk = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return raw[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + raw[33:]


def chat(text: str, *images: str, image_first: bool = True, **fields) -> dict:
    """A one-message chat request: the images (as image_url parts) before or after the text."""
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    text_part = [{"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": parts + text_part if image_first else text_part + parts}],
            **fields}
