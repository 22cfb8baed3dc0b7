"""`view_image`: attach a local image from the workspace to the conversation.

The image is opened through the workspace's directory fd (see `toolq.workers.workspace`), only a
regular file is read, and never more than `MAX_IMAGE_BYTES` of it, charged against the sandbox's
memory limit with its base64 text (`CallBudget`).
"""

from __future__ import annotations

import base64
import os

from pydantic import BaseModel, Field

from toolq.core.catalog import ToolContext, tool
from toolq.core.errors import RespondToModel
from toolq.core.items import InputImage
from toolq.workers.call_budget import CallBudget
from toolq.workers.reading import read_at_most
from toolq.workers.workspace import NotARegularFile, Workspace, describe

#: Larger images would bloat every later request of the turn; the Responses API caps input images too.
MAX_IMAGE_BYTES = 20 * 1024 * 1024
#: Memory an image holds per byte: its bytes, its base64 text and the data URL made of it.
BYTES_PER_BYTE = 4

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
    with Workspace(ctx.workspace) as ws:
        target = ws.locate(args.path)
        path = ws.display(target)
        try:
            fd, status = ws.open_file(target)
        except FileNotFoundError:
            # Codex's words for a missing image, which models know.
            missing = f"unable to locate image at `{path}`: No such file or directory (os error 2)"
            raise RespondToModel(missing) from None
        except (IsADirectoryError, NotARegularFile):
            raise RespondToModel(f"image path `{path}` is not a file") from None
        except OSError as e:
            raise RespondToModel(f"unable to read image at `{path}`: {describe(e)}") from None
    try:
        data = read_at_most(fd, MAX_IMAGE_BYTES + 1)
    except OSError as e:
        raise RespondToModel(f"unable to read image at `{path}`: {describe(e)}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_IMAGE_BYTES:
        size = max(status.st_size, len(data))
        raise RespondToModel(f"image `{path}` is too large ({size} bytes; the limit is {MAX_IMAGE_BYTES})")
    CallBudget(ctx, "view_image").charge(len(data) * BYTES_PER_BYTE, f"image `{path}` ({len(data)} bytes)")
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
