"""What the archive code passes around: the caps (`Limits`), a tree's entries (`Entry`, `Manifest`),
a packed upload (`Packed`), what applying did (`ApplyReport`), `ArchiveError`, and the checks on
names and symlinks every other module of the package shares (`_checked_name`, `_Links`).

A tree carries regular files, directories and symlinks that stay inside it, with UTF-8 names only
(the records naming them are JSON); what else a tree holds is refused (an upload) or left out and
said (a checkpoint's `Delta.skipped`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from toolq.workers.workspace import MAX_SYMLINKS, PROTECTED_DIR

if TYPE_CHECKING:
    from toolq.core.settings import Settings


MiB = 1 << 20
Kind = Literal["file", "dir", "symlink"]


class ArchiveError(Exception):
    """A tree or tar refused: one line for the user, naming the member."""


@dataclass(frozen=True)
class Limits:
    """Caps on one tar or tree: its files' bytes and its members (files, directories and links)."""

    max_bytes: int
    max_files: int

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        return cls(max_bytes=settings.upload_max_mb * MiB, max_files=settings.upload_max_files)


DEFAULT_LIMITS = Limits(max_bytes=256 * MiB, max_files=100_000)


@dataclass(frozen=True)
class Entry:
    """One member of a tree: a regular file (its size and sha256), a directory, or a symlink (its
    target). `mode` holds the permission bits only (no suid, sgid or sticky bit)."""

    kind: Kind
    mode: int
    size: int = 0
    sha256: str | None = None
    target: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in (("kind", self.kind), ("mode", self.mode), ("size", self.size),
                                  ("sha256", self.sha256), ("target", self.target)) if v is not None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Entry:
        return cls(kind=data["kind"], mode=int(data["mode"]), size=int(data.get("size", 0)),
                   sha256=data.get("sha256"), target=data.get("target"))


Manifest = dict[str, Entry]


def manifest_to_json(manifest: Manifest) -> dict[str, dict[str, Any]]:
    return {path: entry.to_json() for path, entry in sorted(manifest.items())}


def manifest_from_json(data: dict[str, dict[str, Any]]) -> Manifest:
    return {path: Entry.from_json(entry) for path, entry in data.items()}


@dataclass(frozen=True)
class Packed:
    """A folder packed for upload: the tar (its sha256 is its blob id) and what it holds."""

    tar: bytes
    manifest: Manifest
    skipped: list[str] = field(default_factory=list)
    """Sockets, FIFOs and devices in the folder: a tar carries none."""

    @property
    def blob(self) -> str:
        return hashlib.sha256(self.tar).hexdigest()


@dataclass
class ApplyReport:
    """What `apply_delta` did to the user's folder: the paths applied and those refused, each with
    its reason (one line each)."""

    applied: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [f"not applied: {path} ({reason})" for path, reason in self.refused]


def _order(path: str) -> list[str]:
    """Sort key: a directory's members right after it, before its next sibling (`a`, `a/x`, `a-b`)."""
    return path.split("/")


def _in_git_dir(path: str) -> bool:
    return any(part.lower() == PROTECTED_DIR for part in path.split("/"))


def _parents(path: str) -> Iterator[str]:
    """`a/b/c` -> `a`, `a/b`."""
    parts = path.split("/")
    for i in range(1, len(parts)):
        yield "/".join(parts[:i])


def _checked_name(raw: str, what: str = "the archive's member") -> str | None:
    """A member's name made relative (`./` and a trailing `/` dropped); None for the root itself.
    Raises for a name that could land anywhere but below the destination."""
    if "\0" in raw:
        raise ArchiveError(f"{what} {raw!r} has a NUL byte in its name")
    if raw.startswith("/"):
        raise ArchiveError(f"{what} {raw!r} has an absolute path")
    name = raw.rstrip("/")
    while name.startswith("./"):
        name = name[2:].lstrip("/")
    if name in ("", "."):
        return None
    parts = name.split("/")
    if ".." in parts:
        raise ArchiveError(f"{what} {raw!r} has a `..` component")
    if "" in parts or "." in parts:
        raise ArchiveError(f"{what} {raw!r} is not a plain relative path")
    if len(parts) > MAX_DEPTH or len(os.fsencode(name)) > MAX_PATH or any(len(os.fsencode(p)) > 255 for p in parts):
        # each level holds an fd while it is written: a name thousands deep would run a worker out of them
        raise ArchiveError(f"{what} {_short(raw)!r} is longer or deeper than a path may be here "
                           f"({MAX_PATH} bytes, {MAX_DEPTH} levels, 255 bytes a name)")
    return name


def _short(text: str, most: int = 120) -> str:
    return text if len(text) <= most else text[:most] + "..."


#: The longest path and the deepest one a tree may hold (the kernel's PATH_MAX; levels of directories).
MAX_PATH = 4095
MAX_DEPTH = 256
OUTSIDE = "leads outside"
_LOOPS = "loops"


#: The kernel's limit on a symlink's target (PATH_MAX less its NUL).
MAX_LINK_TARGET = 4095


class _Links:
    """A tree's symlinks resolved from the tree's own links, as the kernel would resolve them,
    without a file system: `s -> .` then `q -> s/..` leaves the tree, though `q`'s target alone does
    not look like it. A missing component counts as a directory. Each link is resolved once."""

    def __init__(self, links: dict[str, str]) -> None:
        self.links = links
        self._resolved: dict[str, list[str] | str] = {}  # a link -> where it leads (parts) or why not
        self._active: list[str] = []

    def why_out(self, path: str) -> str | None:
        """None if link `path` stays inside; else why not (`leads outside`, ...). A link that loops,
        or only resolves through more than 40 links, leads nowhere (the kernel gives ELOOP): it
        stays, as a broken link does."""
        found = self._resolve(path)
        return found if isinstance(found, str) and found != _LOOPS else None

    def _resolve(self, path: str) -> list[str] | str:
        if path in self._resolved:
            return self._resolved[path]
        if path in self._active or len(self._active) >= MAX_SYMLINKS:
            return _LOOPS  # not kept: from a shallower start the same link may resolve
        target = self.links[path]
        if not target or "\0" in target:
            found: list[str] | str = "has no usable target"
        elif len(os.fsencode(target)) > MAX_LINK_TARGET:
            found = f"has a target longer than {MAX_LINK_TARGET} bytes"
        elif target.startswith("/"):
            found = OUTSIDE
        else:
            self._active.append(path)
            try:
                found = self._walk(path.split("/")[:-1], target)
            finally:
                self._active.pop()
            if found == _LOOPS:
                return found
        self._resolved[path] = found
        return found

    def _walk(self, here: list[str], target: str) -> list[str] | str:
        for part in target.split("/"):
            if part in ("", "."):
                continue
            if part == "..":
                if not here:
                    return OUTSIDE
                here.pop()
                continue
            step = "/".join([*here, part])
            if step not in self.links:
                here.append(part)
                continue
            found = self._resolve(step)
            if isinstance(found, str):
                return found
            here = list(found)
        return here


def _is_utf8(path: str) -> bool:
    """Whether a name (decoded with surrogateescape, as os gives it) is UTF-8: only those travel,
    as the records naming them are JSON."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(path: str) -> str:
    """A name as text that any JSON can carry (bytes that are not UTF-8 as \\xNN)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")
