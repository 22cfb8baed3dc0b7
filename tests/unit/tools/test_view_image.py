"""view_image: a workspace image becomes one high-detail input_image data URL."""

from __future__ import annotations

import base64
import json
import os

import pytest

from tests.unit.tools import call
from toolq.core.errors import RespondToModel
from toolq.core.items import InputImage
from toolq.workers.tools import view_image as module
from toolq.workers.tools.view_image import view_image

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16
JPEG = b"\xff\xd8\xff\xe0" + b"\0" * 16
WEBP = b"RIFF\x10\0\0\0WEBPVP8 " + b"\0" * 8


def run(tmp_path, path: str):
    return call(view_image, tmp_path, json.dumps({"path": path}))


def error(tmp_path, path: str) -> str:
    with pytest.raises(RespondToModel) as e:
        run(tmp_path, path)
    return e.value.message


@pytest.mark.parametrize(("name", "data", "mime"), [("a.png", PNG, "image/png"), ("b.bin", JPEG, "image/jpeg"),
                                                    ("c.webp", WEBP, "image/webp"), ("d.gif", b"GIF89a...", "image/gif")])
def test_image_becomes_a_data_url_typed_by_its_content(tmp_path, name, data, mime):
    (tmp_path / name).write_bytes(data)
    out = run(tmp_path, name)
    assert out == [InputImage(image_url=f"data:{mime};base64,{base64.b64encode(data).decode()}", detail="high")]
    assert out[0].to_wire()["type"] == "input_image"


def test_missing_file_and_directory_are_clear_errors(tmp_path):
    assert error(tmp_path, "nope.png") == (
        f"unable to locate image at `{tmp_path.resolve()}/nope.png`: No such file or directory (os error 2)"
    )
    (tmp_path / "dir").mkdir()
    assert error(tmp_path, "dir") == f"image path `{tmp_path.resolve()}/dir` is not a file"


def test_non_image_is_refused(tmp_path):
    (tmp_path / "fake.png").write_text("not an image")
    assert error(tmp_path, "fake.png") == f"`{tmp_path.resolve()}/fake.png` is not a supported image (png, jpeg, gif or webp)"


def test_oversized_image_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(module, "MAX_IMAGE_BYTES", 10)
    (tmp_path / "big.png").write_bytes(PNG)
    assert "is too large (24 bytes; the limit is 10)" in error(tmp_path, "big.png")


@pytest.mark.parametrize("path", ["../x.png", "/etc/x.png", "link.png"])
def test_images_outside_the_workspace_are_refused(tmp_path, path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (tmp_path / "x.png").write_bytes(PNG)
    (ws / "link.png").symlink_to(tmp_path / "x.png")
    assert f"`{path}`" in error(ws, path)


def test_a_fifo_is_not_a_file_and_does_not_block(tmp_path):
    os.mkfifo(tmp_path / "pipe.png")
    assert error(tmp_path, "pipe.png") == f"image path `{tmp_path.resolve()}/pipe.png` is not a file"
