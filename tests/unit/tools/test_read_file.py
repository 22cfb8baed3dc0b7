"""read_file: numbered slices of a workspace file, Codex's argument errors, confinement."""

from __future__ import annotations

import json
import os
import tracemalloc

import pytest

from tests.unit.tools import call
from toolq.core.errors import RespondToModel
from toolq.workers.tools.read_file import read_file


def run(tmp_path, **arguments) -> str:
    return call(read_file, tmp_path, json.dumps(arguments))


def error(tmp_path, **arguments) -> str:
    with pytest.raises(RespondToModel) as e:
        run(tmp_path, **arguments)
    return e.value.message


@pytest.fixture
def five_lines(tmp_path):
    (tmp_path / "f.txt").write_text("one\ntwo\r\nthree\n\nfive")
    return tmp_path


def test_lines_come_back_numbered_with_crlf_stripped(five_lines):
    assert run(five_lines, file_path="f.txt") == "L1: one\nL2: two\nL3: three\nL4: \nL5: five"


def test_offset_and_limit_select_a_slice(five_lines):
    assert run(five_lines, file_path="f.txt", offset=2, limit=2) == "L2: two\nL3: three"


def test_absolute_path_inside_the_workspace_is_read(five_lines):
    assert run(five_lines, file_path=str(five_lines / "f.txt"), limit=1) == "L1: one"


def test_long_lines_are_cut_to_500_bytes_on_a_character_boundary(tmp_path):
    (tmp_path / "long.txt").write_text("é" * 400 + "\n")
    line = run(tmp_path, file_path="long.txt").removeprefix("L1: ")
    assert line == "é" * 250


def test_invalid_utf8_is_replaced_not_fatal(tmp_path):
    (tmp_path / "bin.txt").write_bytes(b"ok\xff\n")
    assert run(tmp_path, file_path="bin.txt") == "L1: ok\ufffd"


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"offset": 0}, "offset must be a 1-indexed line number"),
        ({"limit": 0}, "limit must be greater than zero"),
        ({"offset": 6}, "offset exceeds file length"),
    ],
)
def test_bad_offset_and_limit_get_codex_messages(five_lines, arguments, message):
    assert error(five_lines, file_path="f.txt", **arguments) == message


def test_empty_file_has_no_line_one(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    assert error(tmp_path, file_path="empty.txt") == "offset exceeds file length"


def test_missing_file_and_directory_are_clear_errors(tmp_path):
    assert error(tmp_path, file_path="nope.txt") == "failed to read file: No such file or directory (os error 2)"
    assert error(tmp_path, file_path=".") == "failed to read file: Is a directory (os error 21)"


@pytest.mark.parametrize("path", ["../secret.txt", "/etc/hostname", "link.txt"])
def test_paths_leaving_the_workspace_are_refused(tmp_path, path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (tmp_path / "secret.txt").write_text("s3cret\n")
    (ws / "link.txt").symlink_to(tmp_path / "secret.txt")
    message = error(ws, file_path=path)
    assert f"`{path}`" in message and "s3cret" not in message


def test_missing_file_path_is_a_parse_error(tmp_path):
    with pytest.raises(RespondToModel, match="missing field `file_path`"):
        call(read_file, tmp_path, "{}")


# --- a hostile workspace --------------------------------------------------------------------------


def test_a_3_gib_file_without_newline_is_read_in_bounded_memory(tmp_path):
    with open(tmp_path / "huge.bin", "wb") as f:
        f.truncate(3 * 1024**3)  # sparse: no disk used, 3 GiB of NUL bytes and no newline
    tracemalloc.start()
    try:
        first = run(tmp_path, file_path="huge.bin", limit=1)
        past = error(tmp_path, file_path="huge.bin", offset=2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert first == "L1: " + "\0" * 500
    assert past == "offset exceeds file length"
    assert peak < 8 * 1024 * 1024, f"read_file held {peak} bytes for one line"


def test_lines_after_a_cut_line_keep_their_numbers(tmp_path):
    (tmp_path / "f.txt").write_bytes(b"x" * 100_000 + b"\nnext\n")
    assert run(tmp_path, file_path="f.txt") == "L1: " + "x" * 500 + "\nL2: next"


def test_a_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "pipe")  # no writer: a blocking open would wait forever
    assert error(tmp_path, file_path="pipe") == "failed to read file: not a regular file (a FIFO)"


def test_the_deadline_is_checked_while_reading(tmp_path):
    (tmp_path / "f.txt").write_text("a\n")
    with pytest.raises(RespondToModel, match="read_file timed out after 0 seconds"):
        call(read_file, tmp_path, json.dumps({"file_path": "f.txt"}), deadline_in=-1)
