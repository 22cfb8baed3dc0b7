"""What the hostile-workspace tests share: a process that races the file tools."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_FLIP = """
import os, shutil, sys, time
d, stash, outside = sys.argv[1:]

def clear():  # a tool made `d` (mkdir -p) while it was missing
    shutil.rmtree(d, ignore_errors=True)

def retry(step):
    while True:
        try:
            return step()
        except OSError:
            clear()

print("flipping", flush=True)
while True:
    os.rename(d, stash)
    retry(lambda: os.symlink(outside, d))
    time.sleep(0.0002)  # rest in each state a little: lookups must meet both, not only the gaps
    os.unlink(d)
    retry(lambda: os.rename(stash, d))
    time.sleep(0.0002)
"""


class Flipper:
    """Swaps `ws/d` between a real directory and a symlink to `outside`, as fast as it can, from
    another process (a thread would share the GIL and barely overlap the tool's system calls)."""

    def __init__(self, ws: Path, outside: Path | str, name: str = "d") -> None:
        self.argv = [sys.executable, "-c", _FLIP, str(ws / name), str(ws / f"{name}.real"), str(outside)]

    def __enter__(self) -> Flipper:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline() == "flipping\n"
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


_EXCHANGE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
a, b = (os.fsencode(p) for p in sys.argv[1:])
print("exchanging", flush=True)
while libc.renameat2(-100, a, -100, b, 2) == 0:  # RENAME_EXCHANGE: never a moment without either
    pass
"""


class Exchanger(Flipper):
    """Swaps `ws/d` (a directory) with a symlink to `outside` atomically (renameat2's
    RENAME_EXCHANGE), as fast as it can: each path is always either, and changes every few us."""

    def __init__(self, ws: Path, outside: Path | str, name: str = "d") -> None:
        os.symlink(outside, ws / f"{name}.link")
        self.argv = [sys.executable, "-c", _EXCHANGE, str(ws / name), str(ws / f"{name}.link")]

    def __enter__(self) -> Exchanger:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline() == "exchanging\n"
        return self


def restore_flipped(ws: Path, name: str = "d") -> None:
    """Put `ws/d` back as the directory a stopped Flipper may have left stashed (`d.real`)."""
    d, stash = ws / name, ws / f"{name}.real"
    if stash.exists():
        if d.is_symlink():
            d.unlink()
        elif d.exists():
            shutil.rmtree(d)
        stash.rename(d)


def race_tree(root: Path) -> tuple[Path, Path]:
    """`root/ws/d/f.txt` ("inside") and `root/outside/f.txt` ("s3cret"), for a Flipper."""
    ws, outside = root / "ws", root / "outside"
    (ws / "d").mkdir(parents=True)
    outside.mkdir()
    (ws / "d" / "f.txt").write_text("inside\n")
    (outside / "f.txt").write_text("s3cret\n")
    return ws, outside


@contextmanager
def deep_tree(root: Path, depth: int, leaf: str) -> Iterator[str]:
    """`root/d/d/.../d/f.txt` (`depth` levels, holding `leaf`), made and removed through fds: its
    path is longer than PATH_MAX, and a recursive rmtree would exceed Python's stack. Yields the
    file's path relative to `root`."""
    fds = [os.open(root, os.O_PATH | os.O_DIRECTORY)]
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fds[-1])
            fds.append(os.open("d", os.O_PATH | os.O_DIRECTORY, dir_fd=fds[-1]))
        with open(os.open("f.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fds[-1]), "w") as f:
            f.write(leaf)
        yield "/".join(["d"] * depth + ["f.txt"])
    finally:
        if len(fds) == depth + 1:
            os.unlink("f.txt", dir_fd=fds[-1])
        while len(fds) > 1:
            os.close(fds.pop())
            os.rmdir("d", dir_fd=fds[-1])
        os.close(fds[0])
