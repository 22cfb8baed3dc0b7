"""The docs for their readers (issue 25 item 6): the README stays short, and every relative link
in the README and docs/ leads to a file of this repository (an anchor, to a heading there)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings."""
    out = set()
    for line in path.read_text().splitlines():
        if m := re.match(r"^#+ (.+)$", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def test_every_relative_link_in_the_docs_resolves():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            where = (doc.parent / path).resolve() if path else doc
            if not where.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
            elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_no_doc_cites_a_file_outside_the_repository():
    cited = [f"{doc.relative_to(ROOT)}: {m}" for doc in DOCS for m in re.findall(r"\.\./shared/\S+", doc.read_text())]
    assert not cited, cited


def test_the_readme_is_for_a_newcomer():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)


def test_the_configuration_doc_is_generated_from_the_settings_model():
    from toolq.orchestrator import config_doc

    assert config_doc.undocumented() == [], "document these settings in toolq/orchestrator/config_doc.py"
    assert (ROOT / "docs" / "configuration.md").read_text() == config_doc.render(), (
        "docs/configuration.md differs from the settings model: "
        "run `.venv/bin/python -m toolq.orchestrator.config_doc > docs/configuration.md`")
