"""`view_image`: attach a local image from the workspace to the conversation."""

from __future__ import annotations

import base64

from pydantic import BaseModel, Field

from toolq.orchestrator.errors import RespondToModel
from toolq.orchestrator.protocol.items import InputImage
from toolq.workers.catalog import ToolContext, tool
from toolq.workers.workspace import resolve_in_workspace

#: Larger images would bloat every later request of the turn; the Responses API caps input images too.
MAX_IMAGE_BYTES = 20 * 1024 * 1024

_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


class ViewImageArgs(BaseModel):
    path: str = Field(description="Path to an image file in the workspace (png, jpeg, gif or webp).")


@tool
def view_image(args: ViewImageArgs, ctx: ToolContext) -> list[InputImage]:
    """View a local image from the workspace (only use if given a path by the user or a tool)."""
    path = resolve_in_workspace(ctx.workspace, args.path)
    if not path.exists():
        raise RespondToModel(f"unable to locate image at `{path}`: No such file or directory (os error 2)")
    if not path.is_file():
        raise RespondToModel(f"image path `{path}` is not a file")
    size = path.stat().st_size
    if size > MAX_IMAGE_BYTES:
        raise RespondToModel(f"image `{path}` is too large ({size} bytes; the limit is {MAX_IMAGE_BYTES})")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise RespondToModel(f"unable to read image at `{path}`: {e.strerror} (os error {e.errno})") from None
    mime = image_mime_type(data)
    if mime is None:
        raise RespondToModel(f"`{path}` is not a supported image (png, jpeg, gif or webp)")
    url = f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"
    return [InputImage(image_url=url, detail="high")]


def image_mime_type(data: bytes) -> str | None:
    """The image type from the file's magic bytes (the extension may lie)."""
    for signature, mime in _SIGNATURES:
        if data.startswith(signature):
            return mime
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None
