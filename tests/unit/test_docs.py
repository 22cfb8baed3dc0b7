"""The docs for their readers (issue 25 item 6), kept honest by the tree they describe.

The README stays short and keeps the two commands; every relative link in the README and docs/
leads to a file of this repository (an anchor, to a heading there); no doc cites a file that is
not in the repository (design notes kept elsewhere); the repository paths, test names and
`toolq` commands a doc names exist; and docs/configuration.md is what the settings model renders.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from toolq.cli.main import build_parser
from toolq.dev import config_doc

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").rglob("*.md")), ROOT / "deploy" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
#: Where the files a doc names live: a path starting with one of these must exist.
TOP = ("toolq", "tests", "examples", "deploy", "docs")
REPO_PATH = re.compile(rf"(?<![\w./~-])((?:{'|'.join(TOP)})/[\w./-]*[\w/])")
#: Notes kept outside the repository that docs once cited.
OUTSIDE = re.compile(r"\.\./shared/|\bseeds/|\bDESIGN\b|\bSTYLE\.md|celery-lab|codex-reference|codex-contracts"
                     r"|responses-protocol")
REGENERATE = ".venv/bin/python -m toolq.dev.config_doc > docs/configuration.md"


def _ids(docs: list[Path]) -> list[str]:
    return [str(d.relative_to(ROOT)) for d in docs]


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings (code blocks left out)."""
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#+ (.+)$", line)):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def _repo_files() -> set[str]:
    """Names of the repository's files (its build and cache folders left out)."""
    names: set[str] = set()
    for _folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d not in ("node_modules", "__pycache__")]
        names.update(files)
    return names


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_every_relative_link_resolves(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (doc.parent / path).resolve() if path else doc
        if not where.exists():
            broken.append(target)
        elif not where.is_relative_to(ROOT):
            broken.append(f"{target} (outside the repository)")
        elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{doc.relative_to(ROOT)}: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_no_doc_cites_a_file_outside_the_repository(doc):
    text = doc.read_text()
    cited = [m.group() for m in OUTSIDE.finditer(text)]
    files = _repo_files()
    cited += [name for name in re.findall(r"(?<![\w/.-])([\w.-]+\.md)\b", text) if name not in files]
    assert not cited, f"{doc.relative_to(ROOT)} cites what the repository does not hold: {cited}"


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_the_repository_paths_a_doc_names_exist(doc):
    # A file (it has an extension) or a folder (written with its slash); `deploy/toolq-worker` is
    # a Kubernetes name.
    named = {p for p in REPO_PATH.findall(doc.read_text()) if p.endswith("/") or "." in p.rsplit("/", 1)[-1]}
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=_ids(DOCS))
def test_the_tests_a_doc_names_exist(doc):
    sources = {p.name: p.read_text() for p in (ROOT / "tests").rglob("test_*.py")}
    missing = []
    for m in re.finditer(r"(?:(test_\w+\.py)|[\s(`])::(test_\w+)", doc.read_text()):
        file = m.group(1) or _last_file(doc.read_text()[: m.start()])
        if file not in sources or not re.search(rf"def {m.group(2)}\b", sources[file]):
            missing.append(f"{file}::{m.group(2)}")
    assert not missing, f"{doc.relative_to(ROOT)} names tests that do not exist: {missing}"


def _last_file(text: str) -> str | None:
    """The test file a bare `::test_name` refers to: the last one named before it."""
    found = re.findall(r"(test_\w+\.py)", text)
    return found[-1] if found else None


#: security.md quotes toolq's own messages (`toolq killed this session: ...`), not commands.
COMMAND_DOCS = [d for d in DOCS if d.name != "security.md"]


@pytest.mark.parametrize("doc", COMMAND_DOCS, ids=_ids(COMMAND_DOCS))
def test_every_toolq_command_a_doc_names_exists(doc):
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    named = set(re.findall(r"`toolq ([a-z][a-z-]*)", doc.read_text()))
    assert named - commands == set(), f"{doc.relative_to(ROOT)}"


def test_the_readme_is_for_a_newcomer():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    # CI extracts nothing from the README but runs `./dev test`; the README says both commands.
    assert "    ./dev demo\n    ./dev test\n" in text
    for doc in ("operating", "configuration", "tools", "library", "security", "ARCHITECTURE", "benchmarks"):
        assert f"](docs/{doc}.md)" in text, f"the README does not link docs/{doc}.md"


def test_the_configuration_doc_is_generated_from_the_settings_model():
    assert config_doc.undocumented() == [], "document these settings in toolq/dev/config_doc.py"
    assert (ROOT / "docs" / "configuration.md").read_text() == config_doc.render(), (
        f"docs/configuration.md differs from the settings model: run `{REGENERATE}`")


def test_the_flags_the_configuration_doc_names_exist():
    commands = build_parser()._subparsers._group_actions[0].choices
    for setting, (names, flag) in config_doc.FLAGS.items():
        for name in names:
            options = {o for action in commands[name]._actions for o in action.option_strings}
            assert flag in options, f"{setting}: `toolq {name}` has no {flag}"


def test_the_variables_read_outside_the_settings_model_are_read_by_the_code():
    source = "\n".join(p.read_text() for p in (ROOT / "toolq").rglob("*.py"))
    for variable, _ in config_doc.ELSEWHERE:
        assert f'"{variable}"' in source, f"no code reads {variable}"
