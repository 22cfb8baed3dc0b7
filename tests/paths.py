"""Where the tests' recorded fixtures sit: `tests/fixtures/` (sources: tests/fixtures/README.md)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
SSE_FIXTURES = FIXTURES / "sse"
CODEX_FIXTURES = FIXTURES / "codex"
