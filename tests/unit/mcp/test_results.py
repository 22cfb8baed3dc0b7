"""`CallToolResult` → tool output, Codex's rules (structured wins, images make content items)."""

from __future__ import annotations

import json

from mcp import types

from toolq.core.items import InputImage, InputText
from toolq.workers.mcp.results import map_result


def result(*content, structured=None, is_error=False) -> types.CallToolResult:
    return types.CallToolResult(content=list(content), structuredContent=structured, isError=is_error)


def text(t: str) -> types.TextContent:
    return types.TextContent(type="text", text=t)


def test_text_content_is_text_one_block_per_line():
    out = map_result(result(text("a"), text("b")))
    assert (out.output, out.is_error) == ("a\nb", False)


def test_structured_content_is_its_json_text_even_beside_text():
    out = map_result(result(text('{"x": 1}'), structured={"city": "Oslo", "n": [1, 2]}))
    assert json.loads(out.output) == {"city": "Oslo", "n": [1, 2]}


def test_images_become_input_image_items_beside_the_text():
    img = types.ImageContent(type="image", data="iVBORw0KGgo=", mimeType="image/png")
    out = map_result(result(text("look"), img))
    assert out.output == [InputText(text="look"), InputImage(image_url="data:image/png;base64,iVBORw0KGgo=",
                                                             detail="high")]


def test_resources_are_their_text_or_a_short_description():
    text_res = types.EmbeddedResource(type="resource", resource=types.TextResourceContents(
        uri="file:///a.txt", text="file body", mimeType="text/plain"))
    blob_res = types.EmbeddedResource(type="resource", resource=types.BlobResourceContents(
        uri="file:///b.bin", blob="AAAA", mimeType="application/octet-stream"))
    link = types.ResourceLink(type="resource_link", uri="file:///c", name="c")
    audio = types.AudioContent(type="audio", data="AAAA", mimeType="audio/wav")
    out = map_result(result(text_res, blob_res, link, audio))
    assert out.output.splitlines() == [
        "file body",
        "[resource file:///b.bin (application/octet-stream, 3 bytes)]",
        "[resource link file:///c (c)]",
        "[audio (audio/wav, 3 bytes)]",
    ]


def test_is_error_marks_the_output_failed():
    out = map_result(result(text("no such repo"), is_error=True))
    assert (out.output, out.is_error) == ("no such repo", True)
