"""grep_files: matching file paths newest first, include globs, limits, and confinement."""

from __future__ import annotations

import json
import os
import tracemalloc

import pytest

from tests.hostile import Flipper, deep_tree, race_tree
from tests.unit.tools import call
from toolq.core.catalog import ToolReturn
from toolq.core.errors import RespondToModel
from toolq.workers.tools import grep_files as grep_module
from toolq.workers.tools.grep_files import grep_files

LINEAR = " (grep_files matches in linear time, as rg does: no backreferences or lookaround)"


def run(tmp_path, **arguments) -> ToolReturn:
    return call(grep_files, tmp_path, json.dumps(arguments))


def error(tmp_path, **arguments) -> str:
    with pytest.raises(RespondToModel) as e:
        run(tmp_path, **arguments)
    return e.value.message


def write(path, text: str, mtime: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    os.utime(path, (mtime, mtime))


@pytest.fixture
def files(tmp_path):
    write(tmp_path / "old.py", "def alpha():\n    pass\n", 1_000)
    write(tmp_path / "pkg" / "new.py", "alpha = 1\n", 3_000)
    write(tmp_path / "mid.ts", "const alpha = 2;\n", 2_000)
    write(tmp_path / "other.py", "beta\n", 4_000)
    write(tmp_path / ".hidden" / "h.py", "alpha\n", 5_000)
    (tmp_path / "blob.bin").write_bytes(b"alpha\0\x01")
    return tmp_path.resolve()


def test_matching_files_come_back_newest_first_as_absolute_paths(files):
    r = run(files, pattern="alpha")
    assert r.output.splitlines() == [str(files / "pkg/new.py"), str(files / "mid.ts"), str(files / "old.py")]
    assert r.success


def test_regex_is_line_oriented(files):
    assert run(files, pattern=r"^def \w+\(").output == str(files / "old.py")


def test_include_glob_filters_by_name_at_any_depth(files):
    assert run(files, pattern="alpha", include="*.py").output.splitlines() == [
        str(files / "pkg/new.py"), str(files / "old.py"),
    ]
    assert run(files, pattern="alpha", include="*.{ts,tsx}").output == str(files / "mid.ts")


def test_path_narrows_the_search_to_a_directory_or_file(files):
    assert run(files, pattern="alpha", path="pkg").output == str(files / "pkg/new.py")
    assert run(files, pattern="alpha", path="old.py").output == str(files / "old.py")


def test_limit_keeps_the_newest_matches(files):
    assert run(files, pattern="alpha", limit=1).output == str(files / "pkg/new.py")


def test_no_match_is_reported_as_codex_does(files):
    r = run(files, pattern="gamma")
    assert (r.output, r.success) == ("No matches found.", False)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"pattern": "  "}, "pattern must not be empty"),
        ({"pattern": "x", "limit": 0}, "limit must be greater than zero"),
        ({"pattern": "("}, "invalid regex `(`: missing ): ("),
        ({"pattern": r"(a)\1"}, r"invalid regex `(a)\1`: invalid escape sequence: \1" + LINEAR),
        ({"pattern": "x(?=y)"}, "invalid regex `x(?=y)`: invalid perl operator: (?=" + LINEAR),
        ({"pattern": "x", "include": "{a,b}" * 11}, f"include glob `{'{a,b}' * 11}` expands to more than 1024 globs"),
    ],
)
def test_bad_arguments_are_clear_errors(files, arguments, message):
    assert error(files, **arguments) == message


def test_missing_path_is_a_clear_error(files):
    assert error(files, pattern="x", path="nope") == f"unable to access `{files}/nope`: No such file or directory (os error 2)"


@pytest.mark.parametrize("path", ["..", "/etc", "out"])
def test_search_roots_outside_the_workspace_are_refused(tmp_path, path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "out").symlink_to(tmp_path)
    assert f"`{path}`" in error(ws, pattern="x", path=path)


def test_symlinks_inside_the_tree_are_not_followed(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (tmp_path / "secret.txt").write_text("needle\n")
    (ws / "link.txt").symlink_to(tmp_path / "secret.txt")
    (ws / "dirlink").symlink_to(tmp_path)
    assert run(ws, pattern="needle").output == "No matches found."


# --- a hostile workspace: every cost bounded --------------------------------------------------------


def test_catastrophic_regex_runs_in_linear_time(tmp_path):
    (tmp_path / "a.txt").write_text("a" * 100_000 + "b\n")  # Python's re would backtrack ~2^100000 ways
    assert run(tmp_path, pattern="(a+)+$").output == "No matches found."
    assert run(tmp_path, pattern="(a+)+b$").output == str(tmp_path.resolve() / "a.txt")


def test_a_3_gib_sparse_file_is_binary_and_skipped_at_once(tmp_path):
    with open(tmp_path / "huge.bin", "wb") as f:
        f.truncate(3 * 1024**3)
    (tmp_path / "hit.txt").write_text("needle\n")
    assert run(tmp_path, pattern="needle").output == str(tmp_path.resolve() / "hit.txt")


def test_a_huge_line_is_searched_in_its_first_8_mib_with_bounded_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(grep_module, "MAX_LINE_BYTES", 1024 * 1024)
    (tmp_path / "early.txt").write_bytes(b"x" * 1000 + b"needle" + b"x" * (24 * 1024 * 1024))
    (tmp_path / "late.txt").write_bytes(b"x" * (2 * 1024 * 1024) + b"needle")
    tracemalloc.start()
    try:
        out = run(tmp_path, pattern="needle").output
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out == str(tmp_path.resolve() / "early.txt")  # late.txt's match lies past the cut
    assert peak < 8 * 1024 * 1024, f"grep_files held {peak} bytes for a 24 MiB line"


def test_a_fifo_in_the_tree_is_skipped_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "hit.txt").write_text("needle\n")
    assert run(tmp_path, pattern="needle").output == str(tmp_path.resolve() / "hit.txt")
    assert run(tmp_path, pattern="needle", path="pipe").output == "No matches found."


def test_the_deadline_is_checked_inside_a_file(tmp_path):
    (tmp_path / "f.txt").write_text("needle\n")
    with pytest.raises(RespondToModel, match="grep_files timed out after 0 seconds"):
        call(grep_files, tmp_path, json.dumps({"pattern": "needle"}), deadline_in=-1)


def test_a_brace_bomb_is_refused_before_any_glob_is_built(tmp_path):
    bomb = "{a,b}" * 64  # 2^64 globs
    assert error(tmp_path, pattern="x", include=bomb) == f"include glob `{bomb}` expands to more than 1024 globs"


def test_nested_braces_expand_like_rg(files):
    assert run(files, pattern="alpha", include="*.{p{y,x},{t,j}s}").output.splitlines() == [
        str(files / "pkg/new.py"), str(files / "mid.ts"), str(files / "old.py"),
    ]


@pytest.mark.parametrize(
    ("text", "pattern", "hit"),
    [
        ("foo\nbar\n", r"foo\sbar", False),  # a match never spans lines
        ("foo\nbar\n", r"\Abar", True),  # \A is the start of a line, as before
        ("foo\r\nx\n", "foo$", True),  # a line is matched without its \r
        ("foo\r\nx\n", r"foo\s", False),  # ... so \s does not find the \r either
        ("x\nfoo", "^foo$", True),  # the last line needs no newline
    ],
)
def test_matching_is_line_by_line(tmp_path, text, pattern, hit):
    (tmp_path / "f.txt").write_bytes(text.encode())
    assert run(tmp_path, pattern=pattern).output == (str(tmp_path.resolve() / "f.txt") if hit else "No matches found.")


def test_a_directory_swapped_for_a_symlink_to_a_fifo_never_blocks_the_walk(tmp_path):
    ws, _ = race_tree(tmp_path)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # no writer, ever: an open that follows a symlink to it without O_NONBLOCK waits
    outcomes = set()
    with Flipper(ws, fifo):
        for _ in range(300):
            outcomes.add(run(ws, pattern="inside").output)
    found = {str(ws.resolve() / d / "f.txt") for d in ("d", "d.real")}  # d.real: the flipper's stash
    assert outcomes <= found | {"\n".join(found), "\n".join(sorted(found, reverse=True)), "No matches found."}


def test_a_tree_deeper_than_the_python_stack_is_searched(tmp_path):
    with deep_tree(tmp_path, 1200, "needle\n") as leaf:  # a recursive walk would hit the recursion limit
        assert run(tmp_path, pattern="needle").output == f"{tmp_path.resolve()}/{leaf}"
