"""Image inputs (worker/images.py) and the cheap image limits of the request schema: every source,
every refusal naming its field and limit, and decoding that never goes past the pixel limit."""

from __future__ import annotations

import base64
import io
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest
from PIL import Image

from schemas import GenerationRequest, InvalidRequestError, RequestLimits
from tests.pictures import data_url, encoded, png_declaring
from worker.image_fetch import AddressPolicy
from worker.images import ImageError, ImagePolicy, image_bytes, load_image

FIELD = "messages[0].content[1].image_url"


@pytest.mark.parametrize("fmt,media_type", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"),
                                            ("GIF", "image/gif")])
def test_data_urls_and_raw_base64_of_each_format_decode_to_rgb(fmt, media_type):
    data = encoded(fmt)
    for url in (data_url(data, media_type), base64.b64encode(data).decode()):
        image = load_image(url, FIELD, ImagePolicy())
        assert image.mode == "RGB" and image.size == (24, 16)
        r, g, b = image.getpixel((5, 5))
        assert abs(r - 200) < 12 and abs(g - 40) < 12 and abs(b - 90) < 12, (fmt, image.getpixel((5, 5)))


def test_a_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (10, 10), c) for c in ((255, 0, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:])
    image = load_image(data_url(out.getvalue(), "image/gif"), FIELD, ImagePolicy())
    assert image.getpixel((3, 3))[0] > 200 and image.getpixel((3, 3))[2] < 50


def test_an_image_larger_than_the_processor_takes_is_scaled_down_at_decoding():
    image = load_image(data_url(encoded("JPEG", (400, 200))), FIELD, ImagePolicy(), fit_pixels=80 * 40)
    assert image.size[0] * image.size[1] <= 80 * 40 and abs(image.size[0] / image.size[1] - 2) < 0.1
    assert load_image(data_url(encoded("PNG", (40, 20))), FIELD, ImagePolicy(), fit_pixels=80 * 40).size == (40, 20)


def refused(url: str, policy: ImagePolicy = ImagePolicy()) -> str:
    with pytest.raises(ImageError) as info:
        load_image(url, FIELD, policy)
    message = str(info.value)
    assert message.startswith(FIELD + ": "), message
    return message


def test_corrupt_truncated_and_unsupported_images_are_refused_with_the_reason():
    png = encoded("PNG", (64, 64))
    assert "could not" in refused(data_url(png[:8] + b"\x00" * 60))  # a PNG signature, then garbage
    noisy = io.BytesIO()
    Image.frombytes("RGB", (64, 64), os.urandom(64 * 64 * 3)).save(noisy, "JPEG")
    cut = noisy.getvalue()[: len(noisy.getvalue()) * 2 // 3]  # the header whole, the scan cut short
    assert "could not decode the JPEG image" in refused(data_url(cut, "image/jpeg"))
    for fmt in ("BMP", "TIFF"):
        assert "unsupported image format" in refused(base64.b64encode(encoded(fmt)).decode())
    assert "unsupported image type 'image/bmp'" in refused(data_url(encoded("BMP"), "image/bmp"))
    assert "must be base64" in refused("data:image/png," + "x" * 20)
    assert "invalid base64" in refused("data:image/png;base64,@@@@")


def test_pixels_are_counted_from_the_header_before_decoding_so_a_bomb_fails_alone():
    assert "5000x9000 = 45000000 pixels exceed the limit of 40000000 (MLXQ_MAX_IMAGE_PIXELS)" in refused(
        data_url(png_declaring(5000, 9000)))
    huge = refused(data_url(png_declaring(50_000, 50_000)))  # past Pillow's own limit too, checked as it opens
    assert "more pixels than the limit of 40000000 (MLXQ_MAX_IMAGE_PIXELS)" in huge and "2500000000" in huge
    bomb = io.BytesIO()
    Image.new("1", (8000, 8000)).save(bomb, "PNG")  # 64 megapixels in a few kilobytes
    assert len(bomb.getvalue()) < 100_000
    assert "8000x8000" in refused(data_url(bomb.getvalue()))
    small = ImagePolicy(max_pixels=100)
    assert "24x16 = 384 pixels exceed the limit of 100" in refused(data_url(encoded("PNG")), small)


def test_bytes_are_limited_for_every_source(tmp_path):
    big = encoded("PNG", (64, 64), (1, 2, 3)) + b"\x00" * 5000
    policy = ImagePolicy(max_bytes=1000, image_dir=str(tmp_path))
    assert "exceed the limit of 1000 bytes (MLXQ_MAX_IMAGE_BYTES)" in refused(data_url(big), policy)
    assert "exceed the limit of 1000 bytes" in refused(base64.b64encode(big).decode(), policy)
    (tmp_path / "big.png").write_bytes(big)
    assert "exceed the limit of 1000 bytes" in refused("big.png", policy)


@pytest.fixture
def image_dir(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(allowed dir with ok.png, a sibling dir outside it with secret.png)."""
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    (allowed / "sub" / "ok.png").write_bytes(encoded("PNG"))
    (outside / "secret.png").write_bytes(encoded("PNG"))
    yield allowed, outside


def test_local_files_come_only_from_the_image_directory(image_dir):
    allowed, outside = image_dir
    policy = ImagePolicy(image_dir=str(allowed))
    for inside in ("sub/ok.png", str(allowed / "sub" / "ok.png"), f"file://{allowed}/sub/ok.png",
                   "sub/../sub/ok.png"):
        assert load_image(inside, FIELD, policy).size == (24, 16), inside
    for escape in ("../outside/secret.png", "sub/../../outside/secret.png", str(outside / "secret.png"),
                   f"file://{outside}/secret.png", "/etc/passwd", "../outside/missing.png"):
        assert "is outside the image directory (MLXQ_IMAGE_DIR)" in refused(escape, policy), escape
    assert "cannot open" in refused("sub/missing.png", policy)
    assert "not a regular file" in refused("sub", policy)
    assert "MLXQ_IMAGE_DIR is not set" in refused("sub/ok.png", ImagePolicy())


def test_symlinks_cannot_lead_out_of_the_image_directory(image_dir):
    allowed, outside = image_dir
    (allowed / "link-out.png").symlink_to(outside / "secret.png")
    (allowed / "dir-out").symlink_to(outside)
    (allowed / "link-in.png").symlink_to(allowed / "sub" / "ok.png")
    policy = ImagePolicy(image_dir=str(allowed))
    assert "outside the image directory" in refused("link-out.png", policy)
    assert "outside the image directory" in refused("dir-out/secret.png", policy)
    assert load_image("link-in.png", FIELD, policy).size == (24, 16)


def test_other_url_schemes_are_refused():
    assert "unsupported URL scheme 'ftp'" in refused("ftp://example.com/a.png")
    assert "name this machine only" in refused("file://elsewhere/a.png", ImagePolicy(image_dir="/tmp"))


class _ImageServer(BaseHTTPRequestHandler):
    png = encoded("PNG", (30, 20))

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/ok.png":
            self._send(self.png)
        elif self.path == "/big.png":
            self._send(self.png + b"\x00" * 5000)
        elif self.path.startswith("/hop/"):
            left = int(self.path.rsplit("/", 1)[1])
            self.send_response(302)
            self.send_header("Location", "/ok.png" if left == 0 else f"/hop/{left - 1}")
            self.end_headers()
        elif self.path == "/slow.png":
            time.sleep(1.5)
            self._send(self.png)
        else:
            self.send_error(404)

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _ImageServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_http_urls_fail_unless_fetching_is_on_and_then_within_limits(server):
    assert "MLXQ_IMAGE_FETCH is off" in refused(f"{server}/ok.png")
    # The server is on loopback, which fetches never reach unless the operator allows it (the test seam).
    # Fetches that succeed get time to spare on a loaded machine; the slow one is cut off at 0.5 s.
    fetching = ImagePolicy(fetch=True, max_bytes=1000, fetch_timeout_s=30, fetch_max_redirects=2,
                           fetch_addresses=AddressPolicy.parse(["127.0.0.1/32"]))
    impatient = ImagePolicy(fetch=True, max_bytes=1000, fetch_timeout_s=0.5, fetch_max_redirects=2,
                            fetch_addresses=AddressPolicy.parse(["127.0.0.1/32"]))
    assert "not a public address" in refused(f"{server}/ok.png", ImagePolicy(fetch=True))
    assert load_image(f"{server}/ok.png", FIELD, fetching).size == (30, 20)
    assert load_image(f"{server}/hop/1", FIELD, fetching).size == (30, 20)
    assert "more than 2 redirects (MLXQ_IMAGE_FETCH_MAX_REDIRECTS)" in refused(f"{server}/hop/5", fetching)
    assert "exceed the limit of 1000 bytes" in refused(f"{server}/big.png", fetching)
    assert "longer than 0.5 s (MLXQ_IMAGE_FETCH_TIMEOUT_S)" in refused(f"{server}/slow.png", impatient)
    assert "fetching the image failed" in refused(f"{server}/missing.png", fetching)


def test_a_short_base64_looking_name_is_a_path_not_an_image(tmp_path):
    (tmp_path / "cats").mkdir()
    (tmp_path / "cats" / "tabbycat").write_bytes(encoded("PNG"))
    policy = ImagePolicy(image_dir=str(tmp_path))
    assert image_bytes("cats/tabbycat", FIELD, policy) == encoded("PNG")  # base64 characters, 12 of them


def image_request(count: int, url: str) -> dict:
    parts = [{"type": "text", "text": "look"}] + [{"type": "image_url", "image_url": {"url": url}}] * count
    return {"messages": [{"role": "user", "content": parts}]}


def test_the_schema_checks_image_count_and_inline_size_before_any_decoding():
    limits = RequestLimits(max_images=2, max_image_bytes=1000)
    small = data_url(encoded("PNG"))
    assert GenerationRequest.validate_payload(image_request(2, small), limits)
    with pytest.raises(InvalidRequestError) as info:
        GenerationRequest.validate_payload(image_request(3, small), limits)
    assert "messages: 3 images exceed the limit of 2 per request (MLXQ_MAX_IMAGES)" in str(info.value)
    assert info.value.field == "messages"
    with pytest.raises(InvalidRequestError) as info:
        GenerationRequest.validate_payload(image_request(1, data_url(os.urandom(3000))), limits)
    assert f"{FIELD}: an inline image of about 3000 bytes exceeds the limit of 1000 bytes" in str(info.value)
    assert info.value.field == FIELD
