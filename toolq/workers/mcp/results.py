"""An MCP `CallToolResult` as a tool output (Codex's `as_function_call_output_payload`, with text as text).

- structured content (non-null) → its JSON text;
- otherwise, with any image → content items (`input_text` / `input_image` data URLs);
- otherwise → the texts, one per line; resources as their text, blobs, audio and links as a short
  description of what they are;
- `isError: true` → the same output, marked failed.
"""

from __future__ import annotations

import json
from typing import Any

from mcp import types

from toolq.core.items import ContentPart, InputImage, InputText
from toolq.workers.mcp.wire import McpOutput


def map_result(result: types.CallToolResult) -> McpOutput:
    is_error = bool(result.isError)
    if result.structuredContent is not None:
        return McpOutput(output=json.dumps(result.structuredContent, ensure_ascii=False), is_error=is_error)
    if any(isinstance(c, types.ImageContent) for c in result.content):
        return McpOutput(output=[_part(c) for c in result.content], is_error=is_error)
    return McpOutput(output="\n".join(_text(c) for c in result.content), is_error=is_error)


def _part(block: Any) -> ContentPart:
    if isinstance(block, types.ImageContent):
        detail = (block.meta or {}).get("codex/imageDetail", "high")
        return InputImage(image_url=f"data:{block.mimeType};base64,{block.data}", detail=detail)
    return InputText(text=_text(block))


def _text(block: Any) -> str:
    if isinstance(block, types.TextContent):
        return block.text
    if isinstance(block, types.EmbeddedResource):
        res = block.resource
        if isinstance(res, types.TextResourceContents):
            return res.text
        return f"[resource {res.uri} ({res.mimeType or 'binary'}, {_b64_size(res.blob)} bytes)]"
    if isinstance(block, types.ResourceLink):
        return f"[resource link {block.uri}" + (f" ({block.name})" if block.name else "") + "]"
    if isinstance(block, types.ImageContent):
        return f"[image ({block.mimeType}, {_b64_size(block.data)} bytes)]"
    if isinstance(block, types.AudioContent):
        return f"[audio ({block.mimeType}, {_b64_size(block.data)} bytes)]"
    return json.dumps(block.model_dump(mode="json", exclude_none=True))  # a content type newer than this SDK


def _b64_size(data: str) -> int:
    return len(data) * 3 // 4 - data[-2:].count("=")
