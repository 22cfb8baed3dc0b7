"""Tars, written and read. The tars written here are deterministic (sorted, mtime 0, owner 0 with
no names, permission bits only), so one folder always packs to one blob id and the store keeps it
once (`_TarWriter`, `_tar_of`).

Every tar that reaches a host or comes back from one is hostile input: the commands that wrote a
checkpoint's files are the model's. So a tar is only ever *parsed* with `tarfile` (never
`extractall`), and every member is checked before anything is written (`_members`).
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass

from toolq.workers.environments.archive.model import (
    OUTSIDE,
    ArchiveError,
    Entry,
    Kind,
    Limits,
    Manifest,
    _checked_name,
    _Links,
    _order,
    _parents,
)
from toolq.workers.environments.archive.walk import _Budget

# ---- writing tars --------------------------------------------------------------------------------

class _TarWriter:
    """A deterministic tar: members in `_order`, mtime 0, owner 0, no owner names, permission bits."""

    def __init__(self) -> None:
        self._buffer = io.BytesIO()
        self._tar = tarfile.open(fileobj=self._buffer, mode="w", format=tarfile.PAX_FORMAT)
        self._last: list[str] | None = None

    def add(self, name: str, entry: Entry, data: bytes = b"") -> None:
        if self._last is not None and _order(name) <= self._last:
            raise ArchiveError(f"cannot pack {name}: it comes out of order")  # never, but the blob id would change
        self._last = _order(name)
        info = tarfile.TarInfo(name)
        info.mtime = 0
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mode = entry.mode & 0o777
        if entry.kind == "dir":
            info.type = tarfile.DIRTYPE
        elif entry.kind == "symlink":
            info.type = tarfile.SYMTYPE
            info.linkname = entry.target or ""
        else:
            info.size = len(data)
        self._tar.addfile(info, io.BytesIO(data) if entry.kind == "file" else None)

    def finish(self) -> bytes:
        self._tar.close()
        return self._buffer.getvalue()


def _tar_of(members: Iterable[tuple[str, Entry, bytes]]) -> bytes:
    writer = _TarWriter()
    for name, entry, data in sorted(members, key=lambda m: _order(m[0])):
        writer.add(name, entry, data)
    return writer.finish()


# ---- reading tars --------------------------------------------------------------------------------

@dataclass
class _Member:
    name: str
    info: tarfile.TarInfo
    kind: Kind


def _members(tar: bytes, limits: Limits | None, what: str = "the archive", *, links_out: bool = False,
             ) -> list[_Member]:
    """Every member of an untrusted tar, checked before anything is written: plain relative names,
    no duplicates, files, directories and symlinks only, no member under a symlink or a file, no
    link leading out, no name a pax or GNU header changes behind a short one, nothing after the
    last member, and the caps on declared sizes and count. `links_out`: a symlink leading out is
    left for the caller to refuse by itself (applying a checkpoint refuses that one path)."""
    budget = _Budget(limits, what) if limits else None
    found: list[_Member] = []
    try:
        archive = tarfile.open(fileobj=io.BytesIO(tar), mode="r:")
    except tarfile.TarError as e:
        raise ArchiveError(f"{what} is not a tar: {e}") from None
    try:
        while True:
            try:
                info = archive.next()
            except tarfile.TarError as e:
                raise ArchiveError(f"{what} is damaged after {found[-1].name if found else 'its start'}: {e}") from None
            if info is None:
                break
            if "path" in archive.pax_headers or "linkpath" in archive.pax_headers:
                raise ArchiveError(f"{what} has a global pax header that renames its members")
            _check_spelling(tar, info, what)
            name = _checked_name(info.name, f"{what}'s member")
            kind = _member_kind(info, what)
            if name is None:
                if kind != "dir":
                    raise ArchiveError(f"{what}'s member {info.name!r} names the destination itself")
                continue
            if info.size < 0 or (info.size and kind != "file"):
                raise ArchiveError(f"{what}'s member {name} declares a size of {info.size} bytes")
            if budget:
                budget.count(name, info.size if kind == "file" else 0)
            if kind == "file" and info.offset_data + info.size > len(tar):
                raise ArchiveError(f"{what}'s member {name} declares {info.size} bytes but the archive ends first")
            found.append(_Member(name, info, kind))
        end = archive.offset
    finally:
        archive.close()
    if tar[end:].count(0) != len(tar) - end:
        raise ArchiveError(f"{what} has bytes after {found[-1].name if found else 'its start'} that are no tar member "
                           "(a member holding more than it declares?)")
    _check_tree(found, what, links_out)
    return found


def _check_spelling(tar: bytes, info: tarfile.TarInfo, what: str) -> None:
    """A pax or GNU long-name header may give a name the ustar header cannot hold (longer than its
    100 bytes, or not ASCII), never rename a member the ustar header names plainly: a reader that
    skips those headers would see another archive."""
    header = tar[info.offset_data - 512:info.offset_data]
    if len(header) < 512:
        raise ArchiveError(f"{what}'s member {info.name!r} has a truncated header")
    for field_name, value, raw in (("path", info.name, _ustar_name(header)), ("link", info.linkname, header[157:257])):
        spelt = raw.split(b"\0", 1)[0]
        encoded = os.fsencode(value)
        if not value or encoded == spelt or (field_name == "path" and encoded.rstrip(b"/") == spelt.rstrip(b"/")):
            continue
        if len(encoded) <= 100 and value.isascii():
            was = spelt.decode(errors="replace")
            if field_name == "path":
                raise ArchiveError(f"{what}'s member {was!r} is renamed to {value!r} by an extended header")
            raise ArchiveError(f"{what}'s member {info.name!r} has its link target {was!r} changed to {value!r} "
                               "by an extended header")


def _ustar_name(header: bytes) -> bytes:
    """The name a header spells, read as tarfile reads it (its prefix field, whatever the magic)."""
    name = header[0:100].split(b"\0", 1)[0]
    prefix = header[345:500].split(b"\0", 1)[0]
    return prefix + b"/" + name if prefix else name


def _member_kind(info: tarfile.TarInfo, what: str) -> Kind:
    if info.issparse():
        raise ArchiveError(f"{what}'s member {info.name!r} is a sparse file, which toolq does not unpack")
    if info.isreg():
        return "file"
    if info.isdir():
        return "dir"
    if info.issym():
        return "symlink"
    kind = ("a hard link" if info.islnk() else "a character device" if info.ischr() else "a block device"
            if info.isblk() else "a FIFO" if info.isfifo() else f"of type {info.type!r}")
    raise ArchiveError(f"{what}'s member {info.name!r} is {kind}, which toolq does not unpack")


def _check_tree(found: list[_Member], what: str, links_out: bool) -> None:
    kinds: dict[str, Kind] = {}
    for member in found:
        if member.name in kinds:
            raise ArchiveError(f"{what} holds {member.name} twice")
        kinds[member.name] = member.kind
    for member in found:
        for parent in _parents(member.name):
            if kinds.get(parent, "dir") != "dir":
                raise ArchiveError(f"{what}'s member {member.name} lies under {parent}, which is a {kinds[parent]}")
    if links_out:
        return
    links = {m.name: m.info.linkname for m in found if m.kind == "symlink"}
    resolver = _Links(links)
    for name, target in links.items():
        if why := resolver.why_out(name):
            raise ArchiveError(f"{what}'s symlink {name} -> {target!r} {why}" + (" it" if why == OUTSIDE else ""))


def _member_data(tar: bytes, member: _Member) -> bytes:
    start = member.info.offset_data
    return tar[start:start + member.info.size]


def _entry_of(member: _Member, data: bytes = b"") -> Entry:
    mode = member.info.mode & 0o777
    if member.kind == "file":
        return Entry("file", mode, len(data), hashlib.sha256(data).hexdigest())
    if member.kind == "symlink":
        return Entry("symlink", 0o777, target=member.info.linkname)
    return Entry("dir", mode)


def manifest_of(tar: bytes) -> Manifest:
    """What a tar holds: path -> Entry (its members checked as `extract` checks them, caps aside)."""
    return {m.name: _entry_of(m, _member_data(tar, m) if m.kind == "file" else b"") for m in _members(tar, None)}
