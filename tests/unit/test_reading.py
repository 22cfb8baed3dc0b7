"""toolq.workers.reading: lines cut at a cap however long, a file read only up to a limit."""

from __future__ import annotations

import os
import tracemalloc

import pytest

from toolq.workers import reading
from toolq.workers.reading import bounded_lines, read_at_most


def lines_of(tmp_path, data: bytes, keep: int = 5) -> list[bytes]:
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        return list(bounded_lines(fd, keep))
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("data", "lines"),
    [
        (b"", []),
        (b"\n", [b""]),
        (b"a\nb", [b"a", b"b"]),
        (b"a\nb\n", [b"a", b"b"]),
        (b"abcdefgh\nxy\n", [b"abcde", b"xy"]),
        (b"\n\nabcdefghij", [b"", b"", b"abcde"]),
    ],
)
def test_lines_are_split_on_newlines_and_cut_at_the_cap(tmp_path, data, lines):
    assert lines_of(tmp_path, data) == lines


def test_lines_spanning_chunks_are_joined_then_cut(tmp_path, monkeypatch):
    monkeypatch.setattr(reading, "CHUNK_BYTES", 3)
    assert lines_of(tmp_path, b"ab\ncdefgh\nij", keep=4) == [b"ab", b"cdef", b"ij"]


def test_a_long_line_is_read_past_in_bounded_memory(tmp_path):
    path = tmp_path / "long"
    path.write_bytes(b"x" * (32 * 1024 * 1024) + b"\nnext")
    fd = os.open(path, os.O_RDONLY)
    tracemalloc.start()
    try:
        assert list(bounded_lines(fd, 10)) == [b"x" * 10, b"next"]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        os.close(fd)
    assert peak < 3 * reading.CHUNK_BYTES, f"held {peak} bytes reading a 32 MiB line"  # a chunk or two


def test_every_chunk_goes_through_the_check_first(tmp_path):
    (tmp_path / "f").write_bytes(b"a\n" * 10)
    fd = os.open(tmp_path / "f", os.O_RDONLY)

    def refuse(chunk: bytes) -> None:
        raise TimeoutError

    with pytest.raises(TimeoutError):
        next(bounded_lines(fd, 10, refuse))
    os.close(fd)


def test_read_at_most_stops_at_the_limit(tmp_path):
    (tmp_path / "f").write_bytes(b"0123456789")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    assert read_at_most(fd, 4) == b"0123"
    assert read_at_most(fd, 100) == b"456789"
    os.close(fd)


@pytest.mark.parametrize(
    ("data", "blocks"),
    [
        (b"", []),
        (b"ab\ncd\nef", [b"ab\ncd", b"ef"]),  # chunks "ab\ncd\ne", "f"
        (b"abcdefghijklmno\nxy\n", [b"abcdefgh\nxy"]),  # a line spanning chunks, cut at keep=8
        (b"abcdefghijklmno", [b"abcdefgh"]),
        (b"a\n\n", [b"a\n"]),
    ],
)
def test_line_blocks_are_whole_lines_with_long_ones_cut(tmp_path, monkeypatch, data, blocks):
    monkeypatch.setattr(reading, "CHUNK_BYTES", 7)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        got = list(reading.line_blocks(fd, keep=8))
    finally:
        os.close(fd)
    assert got == blocks
