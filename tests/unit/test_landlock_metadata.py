"""The pure parts of the Landlock metadata supervisor (`toolq/workers/isolation/metadata.py`): how
it reads a path out of a process's memory and the arguments it is given. What it allows and refuses
is tried as the attacker would in tests/integration/test_hostile_landlock.py."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import struct

import pytest

from toolq.workers.isolation import metadata

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


@pytest.fixture
def two_pages():
    base = _libc.mmap(None, 2 * PAGE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert base not in (None, ctypes.c_void_p(-1).value)
    yield base
    _libc.munmap(base, 2 * PAGE)


def test_a_path_is_read_across_a_page_boundary(two_pages):
    path = b"/workspace/a-name-that-crosses-the-page"
    start = two_pages + PAGE - 7
    ctypes.memmove(start, path + b"\0", len(path) + 1)
    assert metadata._read_path(os.getpid(), start) == path


def test_a_path_that_runs_into_unmapped_memory_is_a_fault(two_pages):
    ctypes.memset(two_pages, ord("a"), PAGE)
    _libc.munmap(two_pages + PAGE, PAGE)  # the string has no end before the hole
    with pytest.raises(metadata._Refused) as e:
        metadata._read_path(os.getpid(), two_pages + 10)
    assert e.value.code == errno.EFAULT


def test_a_path_without_an_end_within_path_max_is_too_long():
    text = ctypes.create_string_buffer(b"b" * (metadata.PATH_MAX + 100))
    with pytest.raises(metadata._Refused) as e:
        metadata._read_path(os.getpid(), ctypes.addressof(text))
    assert e.value.code == errno.ENAMETOOLONG
    with pytest.raises(metadata._Refused):
        metadata._read_path(os.getpid(), 0)  # NULL


def test_directory_fds_are_read_as_signed_ints():
    assert metadata._signed(0xFFFFFF9C) == metadata.AT_FDCWD
    assert metadata._signed(0xFFFFFFFF_FFFFFF9C) == metadata.AT_FDCWD  # sign-extended by the C library
    assert metadata._signed(3) == 3


@pytest.mark.parametrize("name,given,expected", [
    ("utime", struct.pack("=qq", 5, 6), (5, 0, 6, 0)),
    ("utimes", struct.pack("=qqqq", 5, 7, 6, 8), (5, 7000, 6, 8000)),
    ("futimesat", struct.pack("=qqqq", 1, 0, 2, 999_999), (1, 0, 2, 999_999_000)),
    ("utimensat", struct.pack("=qqqq", 1, metadata.UTIME_OMIT, 2, metadata.UTIME_NOW),
     (1, metadata.UTIME_OMIT, 2, metadata.UTIME_NOW)),
])
def test_each_times_layout_becomes_two_timespecs(name, given, expected):
    buffer = ctypes.create_string_buffer(given, len(given))
    call = metadata._Call(-1, 0, os.getpid(), ())
    assert struct.unpack("=qqqq", metadata._times(call, name, ctypes.addressof(buffer))) == expected
    assert metadata._times(call, name, 0) is None  # NULL: now


def test_microseconds_out_of_range_are_refused():
    buffer = ctypes.create_string_buffer(struct.pack("=qqqq", 1, 1_000_000, 2, 0), 32)
    with pytest.raises(metadata._Refused) as e:
        metadata._times(metadata._Call(-1, 0, os.getpid(), ()), "utimes", ctypes.addressof(buffer))
    assert e.value.code == errno.EINVAL


def test_only_files_of_the_uid_inside_a_writable_root_pass(tmp_path):
    ws, other = tmp_path / "ws", tmp_path / "ws-other"  # a sibling whose name starts with the root's
    ws.mkdir(), other.mkdir()
    (ws / "f").write_text(""), (other / "f").write_text("")
    command = metadata.Command((str(ws),), os.geteuid())
    for path, allowed in ((ws / "f", True), (ws, True), (other / "f", False)):
        fd = os.open(path, os.O_PATH)
        try:
            if allowed:
                metadata._allowed(fd, command)
            else:
                with pytest.raises(metadata._Refused):
                    metadata._allowed(fd, command)
        finally:
            os.close(fd)
    fd = os.open(ws / "f", os.O_PATH)
    try:
        with pytest.raises(metadata._Refused):  # another uid's
            metadata._allowed(fd, metadata.Command((str(ws),), os.geteuid() + 1))
        os.link(ws / "f", tmp_path / "elsewhere")
        with pytest.raises(metadata._Refused):  # a second name, which may lie outside
            metadata._allowed(fd, command)
        os.unlink(tmp_path / "elsewhere")
        metadata._allowed(fd, command)
        os.unlink(ws / "f")
        with pytest.raises(metadata._Refused):  # removed: where it lived is not known any more
            metadata._allowed(fd, command)
    finally:
        os.close(fd)


def test_the_callers_own_descriptors_in_proc_are_its_own_and_no_one_elses():
    # glibc < 2.39 makes fchmodat(AT_SYMLINK_NOFOLLOW) a chmod of /proc/self/fd/N (tar xp of a
    # folder): the worker resolves it as the caller's descriptor, never as its own /proc/self.
    import threading

    pid, tid = os.getpid(), threading.get_native_id()
    call = metadata._Call(-1, 0, tid, ())
    assert call.own_magic_link(b"/proc/self/fd/3") == (3, b"")
    assert call.own_magic_link(b"/proc/thread-self/fd/12/a/b") == (12, b"a/b")
    assert call.own_magic_link(f"/proc/{pid}/fd/4".encode()) == (4, b"")
    assert call.own_magic_link(f"/proc/{pid}/task/{tid}/fd/4".encode()) == (4, b"")
    assert call.own_magic_link(b"/proc/self/cwd/x") == (metadata.AT_FDCWD, b"x")
    assert call.own_magic_link(b"/proc/1/fd/3") is None  # another process's: not followed
    assert call.own_magic_link(f"/proc/{pid}/task/1/fd/3".encode()) is None
    assert call.own_magic_link(b"/proc/self/task/1/fd/3") is None
    assert call.own_magic_link(b"/proc/self/fdinfo/3") is None
    assert call.own_magic_link(b"/proc/self/fd/3\n") is None
    assert call.own_magic_link(b"/tmp/proc/self/fd/3") is None


def test_fchmod_of_a_path_only_descriptor_is_a_bad_descriptor_as_in_the_kernel(tmp_path):
    import threading

    (tmp_path / "f").write_text("")
    call = metadata._Call(-1, 0, threading.get_native_id(), ())
    path_only = os.open(tmp_path / "f", os.O_PATH)
    readable = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        with pytest.raises(metadata._Refused) as e:
            call.opened(path_only)
        assert e.value.code == errno.EBADF
        with pytest.raises(metadata._Refused) as e:
            call.target(metadata.AT_FDCWD, 0, null_is_dirfd=True)  # utimensat(AT_FDCWD, NULL)
        assert e.value.code == errno.EFAULT
        with pytest.raises(OSError) as kernel:
            os.fchmod(path_only, 0o600)
        assert kernel.value.errno == errno.EBADF
    finally:
        os.close(path_only)
        os.close(readable)
