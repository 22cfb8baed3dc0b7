"""list_dir: Codex's tree layout, paging, argument errors, and symlinks never followed."""

from __future__ import annotations

import json

import pytest

from tests.hostile import deep_tree
from tests.unit.tools import call
from toolq.core.errors import RespondToModel
from toolq.workers.tools.list_dir import list_dir


def run(tmp_path, **arguments) -> str:
    return call(list_dir, tmp_path, json.dumps(arguments))


def error(tmp_path, **arguments) -> str:
    with pytest.raises(RespondToModel) as e:
        run(tmp_path, **arguments)
    return e.value.message


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "src" / "pkg" / "deep").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "deep" / "x.py").write_text("")
    (tmp_path / "src" / "pkg" / "mod.py").write_text("")
    (tmp_path / "src" / "main.py").write_text("")
    (tmp_path / "b.txt").write_text("")
    (tmp_path / "a.txt").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "src")
    return tmp_path


def test_entries_are_sorted_indented_and_marked(tree):
    assert run(tree, dir_path=".") == "\n".join(
        [f"Absolute path: {tree.resolve()}", "a.txt", "b.txt", "link@", "src/", "  main.py", "  pkg/"]
    )


def test_depth_controls_how_far_the_tree_is_walked(tree):
    out = run(tree, dir_path="src", depth=3)
    assert out.splitlines()[1:] == ["main.py", "pkg/", "  deep/", "    x.py", "  mod.py"]
    assert run(tree, dir_path="src", depth=1).splitlines()[1:] == ["main.py", "pkg/"]


def test_limit_cuts_the_list_and_says_so(tree):
    assert run(tree, dir_path=".", limit=2).splitlines()[1:] == ["a.txt", "b.txt", "More than 2 entries found"]


def test_offset_pages_through_entries(tree):
    assert run(tree, dir_path=".", offset=5, limit=2).splitlines()[1:] == ["  main.py", "  pkg/"]


def test_empty_directory_lists_only_its_path(tmp_path):
    (tmp_path / "empty").mkdir()
    assert run(tmp_path, dir_path="empty") == f"Absolute path: {(tmp_path / 'empty').resolve()}"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"offset": 0}, "offset must be a 1-indexed entry number"),
        ({"limit": 0}, "limit must be greater than zero"),
        ({"depth": 0}, "depth must be greater than zero"),
        ({"offset": 99}, "offset exceeds directory entry count"),
    ],
)
def test_bad_arguments_get_codex_messages(tree, arguments, message):
    assert error(tree, dir_path=".", **arguments) == message


def test_missing_directory_is_a_clear_error(tmp_path):
    assert error(tmp_path, dir_path="nope") == "failed to read directory: No such file or directory (os error 2)"


@pytest.mark.parametrize("path", ["..", "/", "out"])
def test_directories_outside_the_workspace_are_refused(tmp_path, path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "out").symlink_to(tmp_path)
    assert f"`{path}`" in error(ws, dir_path=path)


def test_symlinked_directory_inside_is_listed_but_not_entered(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f").write_text("")
    (tmp_path / "alias").symlink_to(tmp_path.parent)  # would lead out if followed
    assert run(tmp_path, dir_path=".", depth=5).splitlines()[1:] == ["alias@", "real/", "  f"]


def test_a_tree_deeper_than_the_python_stack_is_listed(tmp_path):
    with deep_tree(tmp_path, 1200, ""):  # a recursive walk would hit the recursion limit
        out = run(tmp_path, dir_path=".", depth=5000, offset=1199, limit=3)
    assert out.splitlines()[1:] == ["  " * 1198 + "d/", "  " * 1199 + "d/", "  " * 1200 + "f.txt"]
