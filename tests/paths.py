"""Where the shared reference material sits: `../shared` beside the checkout."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
SSE_FIXTURES = SHARED / "fixtures" / "sse"
CODEX_FIXTURES = SHARED / "fixtures" / "codex"


def require_shared() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"reference material not found at {SHARED}")
    return SHARED
