"""apply_patch: Codex's envelope, forgiving matching, verify-before-write and its exact texts (rule 13)."""

from __future__ import annotations

import os

import pytest

from tests.unit.tools import call
from toolq.core.errors import RespondToModel
from toolq.workers.tools import apply_patch as apply_patch_module
from toolq.workers.tools.apply_patch import GRAMMAR, apply_patch

OK = "Exit code: 0\nWall time: 0 seconds\nOutput:\nSuccess. Updated the following files:\n"
FAILED = "apply_patch verification failed: "


def patch(*body: str) -> str:
    return "\n".join(["*** Begin Patch", *body, "*** End Patch"]) + "\n"


def run(tmp_path, text: str) -> str:
    return call(apply_patch, tmp_path, text)


def failure(tmp_path, text: str) -> str:
    with pytest.raises(RespondToModel) as e:
        run(tmp_path, text)
    return e.value.message


def test_add_file_creates_it_and_reports_codex_text(tmp_path):
    out = run(tmp_path, patch("*** Add File: hello.txt", "+Hello", "+", "+world"))
    assert out == OK + "A hello.txt\n"
    assert (tmp_path / "hello.txt").read_text() == "Hello\n\nworld\n"


def test_add_file_creates_parent_directories(tmp_path):
    assert run(tmp_path, patch("*** Add File: a/b/c.txt", "+x")) == OK + "A a/b/c.txt\n"
    assert (tmp_path / "a/b/c.txt").read_text() == "x\n"


def test_summary_lists_added_then_modified_then_deleted(tmp_path):
    (tmp_path / "old.txt").write_text("line\n")
    (tmp_path / "gone.txt").write_text("bye\n")
    (tmp_path / "edit.txt").write_text("a\nb\n")
    out = run(
        tmp_path,
        patch(
            "*** Delete File: gone.txt",
            "*** Update File: old.txt",
            "*** Move to: moved/new.txt",
            "@@",
            "-line",
            "+line2",
            "*** Update File: edit.txt",
            "@@",
            " a",
            "-b",
            "+B",
            "*** Add File: new.txt",
            "+n",
        ),
    )
    assert out == OK + "A new.txt\nM moved/new.txt\nM edit.txt\nD gone.txt\n"
    assert not (tmp_path / "old.txt").exists() and not (tmp_path / "gone.txt").exists()
    assert (tmp_path / "moved/new.txt").read_text() == "line2\n"
    assert (tmp_path / "edit.txt").read_text() == "a\nB\n"


def test_update_with_several_chunks_and_context_headers(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    return 1\n\ndef g():\n    return 1\n")
    run(tmp_path, patch("*** Update File: m.py", "@@ def g():", "-    return 1", "+    return 2"))
    assert (tmp_path / "m.py").read_text() == "def f():\n    return 1\n\ndef g():\n    return 2\n"
    run(tmp_path, patch("*** Update File: m.py", "@@", "-    return 1", "+    return 0", "@@", "-    return 2", "+    return 3"))
    assert (tmp_path / "m.py").read_text() == "def f():\n    return 0\n\ndef g():\n    return 3\n"


def test_update_without_at_at_header_is_accepted_for_the_first_chunk(tmp_path):
    (tmp_path / "f.py").write_text("import foo\n")
    run(tmp_path, patch("*** Update File: f.py", " import foo", "+bar"))
    assert (tmp_path / "f.py").read_text() == "import foo\nbar\n"


def test_matching_forgives_trailing_then_surrounding_whitespace(tmp_path):
    # As in Codex, the matched region (context lines included) is replaced by the patch's lines.
    (tmp_path / "w.txt").write_text("alpha   \n    beta\t\ngamma\n")
    run(tmp_path, patch("*** Update File: w.txt", "@@", " alpha", "-beta", "+BETA"))
    assert (tmp_path / "w.txt").read_text() == "alpha\nBETA\ngamma\n"


def test_exact_match_is_preferred_over_a_forgiving_one(tmp_path):
    (tmp_path / "p.txt").write_text("  x\nx\n")
    run(tmp_path, patch("*** Update File: p.txt", "@@", "-x", "+y"))
    assert (tmp_path / "p.txt").read_text() == "  x\ny\n"


def test_matching_forgives_typographic_punctuation(tmp_path):
    (tmp_path / "q.txt").write_text("say \u201chi\u201d \u2014 ok\n")
    run(tmp_path, patch("*** Update File: q.txt", "@@", '-say "hi" - ok', "+said hi"))
    assert (tmp_path / "q.txt").read_text() == "said hi\n"


def test_end_of_file_marker_anchors_the_change_at_the_end(tmp_path):
    (tmp_path / "t.txt").write_text("x\nend\nx\nend\n")
    run(tmp_path, patch("*** Update File: t.txt", "@@", " x", "-end", "+END", "*** End of File"))
    assert (tmp_path / "t.txt").read_text() == "x\nend\nx\nEND\n"


def test_pure_addition_appends_and_missing_final_newline_is_added(tmp_path):
    (tmp_path / "n.txt").write_text("one")
    run(tmp_path, patch("*** Update File: n.txt", "@@", "+two"))
    assert (tmp_path / "n.txt").read_text() == "one\ntwo\n"


def test_add_overwrites_and_move_overwrites_existing_files(tmp_path):
    (tmp_path / "dup.txt").write_text("old\n")
    (tmp_path / "src.txt").write_text("s\n")
    (tmp_path / "dst.txt").write_text("d\n")
    run(tmp_path, patch("*** Add File: dup.txt", "+new", "*** Update File: src.txt", "*** Move to: dst.txt", "@@", "-s", "+S"))
    assert (tmp_path / "dup.txt").read_text() == "new\n"
    assert (tmp_path / "dst.txt").read_text() == "S\n" and not (tmp_path / "src.txt").exists()


def test_lines_outside_the_change_keep_their_crlf_endings(tmp_path):
    (tmp_path / "c.txt").write_bytes(b"a\r\nb\r\nc\r\n")
    run(tmp_path, patch("*** Update File: c.txt", "@@", "-b", "+B"))
    assert (tmp_path / "c.txt").read_bytes() == b"a\r\nB\nc\r\n"


def test_patch_wrapped_in_a_heredoc_is_accepted(tmp_path):
    out = run(tmp_path, "<<'EOF'\n" + patch("*** Add File: h.txt", "+h") + "EOF\n")
    assert out == OK + "A h.txt\n"


def test_missing_begin_marker_gives_codex_text(tmp_path):
    assert failure(tmp_path, "hello\n*** End Patch") == (
        FAILED + "invalid patch: The first line of the patch must be '*** Begin Patch'"
    )


def test_missing_end_marker_gives_codex_text(tmp_path):
    assert failure(tmp_path, "*** Begin Patch\n*** Add File: a\n+a\n") == (
        FAILED + "invalid patch: The last line of the patch must be '*** End Patch'"
    )


def test_update_of_a_missing_file_names_its_absolute_path(tmp_path):
    assert failure(tmp_path, patch("*** Update File: nope.txt", "@@", "-a", "+b")) == (
        FAILED + f"Failed to read file to update {tmp_path.resolve()}/nope.txt: No such file or directory (os error 2)"
    )


def test_delete_of_a_missing_file_is_a_verification_failure(tmp_path):
    assert failure(tmp_path, patch("*** Delete File: nope.txt")) == (
        FAILED + f"Failed to read {tmp_path.resolve()}/nope.txt: No such file or directory (os error 2)"
    )


def test_delete_of_a_directory_fails(tmp_path):
    (tmp_path / "d").mkdir()
    assert failure(tmp_path, patch("*** Delete File: d")) == (
        FAILED + f"Failed to read {tmp_path.resolve()}/d: Is a directory (os error 21)"
    )


def test_invalid_hunk_header_names_the_line(tmp_path):
    assert failure(tmp_path, patch("*** Add File: a.txt", "+a", "*** Frob File: x")) == (
        FAILED + "invalid hunk at line 4, '*** Frob File: x' is not a valid hunk header. Valid hunk headers: "
        "'*** Add File: {path}', '*** Delete File: {path}', '*** Update File: {path}'"
    )


def test_unexpected_line_in_update_hunk_names_the_line(tmp_path):
    (tmp_path / "u.txt").write_text("a\n")
    assert failure(tmp_path, patch("*** Update File: u.txt", "@@", "garbage")) == (
        FAILED + "invalid hunk at line 4, Unexpected line found in update hunk: 'garbage'. "
        "Every line should start with ' ' (context line), '+' (added line), or '-' (removed line)"
    )


def test_empty_update_hunk_is_invalid(tmp_path):
    assert failure(tmp_path, patch("*** Update File: u.txt")) == (
        FAILED + "invalid hunk at line 2, Update file hunk for path 'u.txt' is empty"
    )


def test_chunk_header_without_lines_is_invalid(tmp_path):
    (tmp_path / "u.txt").write_text("a\n")
    message = failure(tmp_path, patch("*** Update File: u.txt", "@@", "-a", "+A", "@@"))
    assert message == FAILED + "invalid hunk at line 7, Update hunk does not contain any lines"


def test_second_chunk_without_at_at_header_is_invalid(tmp_path):
    (tmp_path / "u.txt").write_text("a\nb\n")
    message = failure(tmp_path, patch("*** Update File: u.txt", "@@", "-a", "+A", "b -> B"))
    assert message == FAILED + "invalid hunk at line 6, Expected update hunk to start with a @@ context marker, got: 'b -> B'"


def test_empty_patch_modifies_nothing(tmp_path):
    assert failure(tmp_path, patch()) == FAILED + "No files were modified."


def test_unmatched_lines_fail_and_nothing_is_written(tmp_path):
    (tmp_path / "f.txt").write_text("real\n")
    message = failure(tmp_path, patch("*** Add File: first.txt", "+x", "*** Update File: f.txt", "@@", "-imagined", "+new"))
    assert message == FAILED + f"Failed to find expected lines in {tmp_path.resolve()}/f.txt:\nimagined"
    assert not (tmp_path / "first.txt").exists()
    assert (tmp_path / "f.txt").read_text() == "real\n"


def test_unknown_context_header_fails(tmp_path):
    (tmp_path / "f.txt").write_text("a\n")
    assert failure(tmp_path, patch("*** Update File: f.txt", "@@ class Missing", "-a", "+b")) == (
        FAILED + f"Failed to find context 'class Missing' in {tmp_path.resolve()}/f.txt"
    )


@pytest.mark.parametrize(
    "hunk",
    [
        ["*** Add File: ../escape.txt", "+x"],
        ["*** Add File: /tmp/escape.txt", "+x"],
        ["*** Add File: out/escape.txt", "+x"],
        ["*** Update File: in.txt", "*** Move to: ../escape.txt", "@@", "-in", "+x"],
        ["*** Delete File: out/victim.txt"],
    ],
)
def test_paths_leaving_the_workspace_are_refused_before_anything_is_written(tmp_path, hunk):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "in.txt").write_text("in\n")
    (tmp_path / "victim.txt").write_text("keep\n")
    (ws / "out").symlink_to(tmp_path)
    message = failure(ws, patch("*** Add File: inside.txt", "+i", *hunk))
    assert message.startswith(FAILED + "path `")
    assert not (ws / "inside.txt").exists()
    assert not (tmp_path / "escape.txt").exists() and (tmp_path / "victim.txt").read_text() == "keep\n"
    assert (ws / "in.txt").read_text() == "in\n"


def test_spec_is_a_serial_custom_tool_with_a_lark_grammar():
    spec = apply_patch.tool_spec
    assert (spec.kind, spec.parallel) == ("custom", False)
    model_spec = spec.model_spec()
    assert model_spec["type"] == "custom" and model_spec["name"] == "apply_patch"
    assert model_spec["format"] == {"type": "grammar", "syntax": "lark", "definition": GRAMMAR}


def test_grammar_accepts_the_envelope_and_rejects_other_text():
    import lark

    parser = lark.Lark(GRAMMAR)
    parser.parse(patch("*** Add File: a.txt", "+a", "+", "*** Delete File: b.txt",
                       "*** Update File: c.txt", "*** Move to: d.txt", "@@ def f():", " ctx", "-old", "+new",
                       " ", "*** End of File"))
    with pytest.raises(lark.exceptions.LarkError):
        parser.parse("*** Begin Patch\n*** Frob File: x\n*** End Patch\n")


# --- a hostile workspace ----------------------------------------------------------------------------

FSMONITOR = ["*** Update File: .git/config", "@@", " [core]", "+\tfsmonitor = touch /tmp/pwned"]


@pytest.fixture
def repo(tmp_path):
    (tmp_path / ".git" / "hooks").mkdir(parents=True)
    (tmp_path / ".git" / "config").write_text("[core]\n")
    (tmp_path / "git_link").symlink_to(".git")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg_link").symlink_to("pkg")
    return tmp_path


@pytest.mark.parametrize(
    ("hunk", "named"),
    [
        (FSMONITOR, ".git/config"),
        (["*** Add File: .git/hooks/pre-commit", "+#!/bin/sh", "+touch /tmp/pwned"], ".git/hooks/pre-commit"),
        (["*** Delete File: .git/config"], ".git/config"),
        (["*** Update File: git_link/config", "@@", " [core]", "+\tfsmonitor = x"], "git_link/config"),
        (["*** Add File: git_link/hooks/post-checkout", "+x"], "git_link/hooks/post-checkout"),
        (["*** Update File: pkg/a.txt", "*** Move to: git_link/config", "@@", "-a", "+[core]"], "git_link/config"),
        (["*** Add File: pkg_link/.git/config", "+x"], "pkg_link/.git/config"),
    ],
)
def test_nothing_under_git_is_created_changed_or_deleted(repo, hunk, named):
    (repo / "pkg" / "a.txt").write_text("a\n")
    message = failure(repo, patch("*** Add File: inside.txt", "+i", *hunk))
    assert message == FAILED + f"path `{named}` is inside a `.git` directory, which file tools do not change"
    assert (repo / ".git" / "config").read_text() == "[core]\n"
    assert sorted(p.name for p in (repo / ".git").rglob("*")) == ["config", "hooks"]
    assert not (repo / "inside.txt").exists() and not (repo / "pkg" / ".git").exists()
    assert (repo / "pkg" / "a.txt").read_text() == "a\n"


def test_a_hard_link_to_a_file_outside_is_not_written_through(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep\n")
    os.link(victim, ws / "linked.txt")
    for hunk in (["*** Update File: linked.txt", "@@", "-keep", "+pwned"], ["*** Add File: linked.txt", "+pwned"]):
        message = failure(ws, patch("*** Add File: inside.txt", "+i", *hunk))
        assert message == FAILED + (
            "path `linked.txt` has 2 hard links: writing it would change a file elsewhere too, so it is not written"
        )
    assert victim.read_text() == "keep\n" and not (ws / "inside.txt").exists()


def test_a_fifo_is_not_read_and_does_not_block(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    assert failure(tmp_path, patch("*** Update File: pipe", "@@", "-a", "+b")) == (
        FAILED + f"Failed to read file to update {tmp_path.resolve()}/pipe: not a regular file (a FIFO)"
    )


def test_deleting_a_symlink_removes_the_link_not_its_target(tmp_path):
    (tmp_path / "real.txt").write_text("real\n")
    (tmp_path / "alias.txt").symlink_to("real.txt")
    assert run(tmp_path, patch("*** Delete File: alias.txt")) == OK + "D alias.txt\n"
    assert not (tmp_path / "alias.txt").is_symlink() and (tmp_path / "real.txt").read_text() == "real\n"


def test_updating_through_a_symlink_inside_changes_its_target(tmp_path):
    (tmp_path / "real.txt").write_text("old\n")
    (tmp_path / "alias.txt").symlink_to(tmp_path / "real.txt")  # absolute, still inside
    assert run(tmp_path, patch("*** Update File: alias.txt", "@@", "-old", "+new")) == OK + "M alias.txt\n"
    assert (tmp_path / "real.txt").read_text() == "new\n" and (tmp_path / "alias.txt").is_symlink()


def test_a_dangling_symlink_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / ".git").mkdir()
    (tmp_path / "hook").symlink_to(".git/pre-commit")  # would create a file in .git if followed
    message = failure(tmp_path, patch("*** Add File: first.txt", "+x", "*** Add File: hook", "+#!/bin/sh"))
    assert message == FAILED + f"Failed to write file {tmp_path.resolve()}/hook: Too many levels of symbolic links (os error 40)"
    assert not (tmp_path / "first.txt").exists() and list((tmp_path / ".git").iterdir()) == []


def test_a_file_over_the_size_cap_is_refused_not_read_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(apply_patch_module, "MAX_FILE_BYTES", 8 * 1024 * 1024)
    with open(tmp_path / "big.txt", "wb") as f:
        f.truncate(3 * 1024**3)  # sparse
    assert failure(tmp_path, patch("*** Update File: big.txt", "@@", "-a", "+b")) == (
        FAILED + f"Failed to read file to update {tmp_path.resolve()}/big.txt: larger than 8 MiB"
    )
