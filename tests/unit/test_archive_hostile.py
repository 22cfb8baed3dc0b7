"""Untrusted archives (issue 28 item 8), written as the attacker would: each tar below is crafted
member by member (raw `TarInfo`s, raw header bytes where tarfile would not lie) to make the host
write outside the environment, follow a link out, make a device, or fill its disk. Each must be
refused with one line naming the member, and leave everything outside the destination as it was:
a sentinel beside it untouched, nothing created next to it nor at the absolute paths it names.
They run as root (the worker's usual user) and, where root can switch, again as `nobody`."""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from toolq.core.environments import Checkpoint
from toolq.workers.environments.archive import ArchiveError, Limits, apply_delta, extract, manifest_of, tree_delta

LIMITS = Limits(max_bytes=1 << 20, max_files=100_000)
#: An absolute path a hostile member names; unique, so its absence proves nothing wrote it.
PWNED = f"/tmp/toolq-pwned-{secrets.token_hex(4)}"
PWNED_ETC = f"/etc/toolq-pwned-{secrets.token_hex(4)}"


def _info(name: str, kind: bytes = tarfile.REGTYPE, *, size: int = 0, link: str = "", mode: int = 0o644,
          pax: dict[str, str] | None = None) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.linkname, info.mode = kind, size, link, mode
    if pax:
        info.pax_headers = dict(pax)
    return info


def _tar(*members: tarfile.TarInfo | tuple[tarfile.TarInfo, bytes], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
        for member in members:
            info, data = member if isinstance(member, tuple) else (member, b"")
            if info.isreg():
                info.size = len(data) if not info.size else info.size
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buffer.getvalue()


def _file(name: str, data: bytes = b"pwned\n", **kw) -> tuple[tarfile.TarInfo, bytes]:
    return _info(name, size=len(data), **kw), data


def _lying_size() -> bytes:
    """A member declaring 1 KB but holding 8 KB: the rest would be read as further headers."""
    header = _info("small.txt", size=1024).tobuf(tarfile.USTAR_FORMAT)
    return header + b"A" * 8192 + b"\0" * 1024


def _huge_declared() -> bytes:
    """A member declaring 8 GB in a 1.5 KB archive (a bomb, as the header tells it)."""
    return _info("bomb.bin", size=8 << 30).tobuf(tarfile.GNU_FORMAT) + b"x" * 512 + b"\0" * 1024


def _hidden_after_the_end() -> bytes:
    """A member after the end-of-archive blocks, which tools that stop there never see."""
    return _tar(_file("ok.txt")) + _tar(_file("../hidden.txt"))


def _negative_size() -> bytes:
    """A size of -1 in GNU's base-256 field: a reader that adds sizes would owe bytes back."""
    return _info("neg.bin", size=-1).tobuf(tarfile.GNU_FORMAT) + b"\0" * 1024


def _directory_with_data() -> bytes:
    """A directory declaring 512 bytes, holding a header some readers skip and others read."""
    hidden = _info("../hidden.txt", size=0).tobuf(tarfile.USTAR_FORMAT)
    return _info("d", tarfile.DIRTYPE, size=512).tobuf(tarfile.USTAR_FORMAT) + hidden + b"\0" * 1024


def _link_chain(n: int) -> bytes:
    return _tar(*(_info(f"l{i}", tarfile.SYMTYPE, link=f"l{i + 1}") for i in range(n)), _file(f"l{n}"))


def _many_files() -> bytes:
    return _tar(*(_info(f"f{i}") for i in range(LIMITS.max_files + 1)), fmt=tarfile.USTAR_FORMAT)


def _gnu_longname_rename() -> bytes:
    """A GNU long-name record giving a short name other than the header's own."""
    long = _info("././@LongLink", b"L", size=len(b"evil.txt\0"))
    return long.tobuf(tarfile.USTAR_FORMAT) + b"evil.txt\0".ljust(512, b"\0") + _tar(_file("innocent.txt"), fmt=tarfile.USTAR_FORMAT)


#: name -> (the tar, what the one-line refusal must say)
ATTACKS: dict[str, tuple[Callable[[], bytes], str]] = {
    "dotdot": (lambda: _tar(_file("../x")), r"^the archive's member '\.\./x' has a `\.\.` component$"),
    "dotdot-deep": (lambda: _tar(_file("a/b/../../../x")), r"has a `\.\.` component"),
    "absolute": (lambda: _tar(_file(PWNED)), rf"^the archive's member '{PWNED}' has an absolute path$"),
    "absolute-etc": (lambda: _tar(_file(PWNED_ETC)), r"has an absolute path"),
    "dotdot-to-etc": (lambda: _tar(_file("../" * 30 + PWNED_ETC.lstrip("/"))), r"has a `\.\.` component"),
    "link-to-root-then-through-it": (lambda: _tar(_info("a", tarfile.SYMTYPE, link="/"), _file(f"a{PWNED}")),
                                     r"symlink a -> '/' leads outside|lies under a, which is a symlink"),
    "link-inside-then-through-it": (lambda: _tar(_info("a", tarfile.SYMTYPE, link="b"), _info("b", tarfile.DIRTYPE),
                                                 _file("a/x")), r"member a/x lies under a, which is a symlink"),
    "file-then-under-it": (lambda: _tar(_file("f"), _file("f/x")), r"member f/x lies under f, which is a file"),
    "link-up-two": (lambda: _tar(_info("up", tarfile.SYMTYPE, link="../..")), r"symlink up -> '\.\./\.\.' leads outside"),
    "link-absolute": (lambda: _tar(_info("etc", tarfile.SYMTYPE, link="/etc")), r"symlink etc -> '/etc' leads outside"),
    "link-out-through-a-link": (lambda: _tar(_info("s", tarfile.SYMTYPE, link="."), _info("q", tarfile.SYMTYPE, link="s/..")),
                                r"symlink q -> 's/\.\.' leads outside"),
    "hard-link": (lambda: _tar(_info("passwd", tarfile.LNKTYPE, link="/etc/passwd")), r"'passwd' is a hard link"),
    "hard-link-inside": (lambda: _tar(_file("a"), _info("b", tarfile.LNKTYPE, link="a")), r"'b' is a hard link"),
    "char-device": (lambda: _tar(_info("mem", tarfile.CHRTYPE)), r"'mem' is a character device"),
    "block-device": (lambda: _tar(_info("sda", tarfile.BLKTYPE)), r"'sda' is a block device"),
    "fifo": (lambda: _tar(_info("pipe", tarfile.FIFOTYPE)), r"'pipe' is a FIFO"),
    "too-many-files": (_many_files, r"more than 100000 files and folders \(at f100000\)"),
    "too-many-bytes": (lambda: _tar(_file("big", b"x" * ((1 << 20) + 1))), r"more than 1 MB of files \(at big\)"),
    "lying-size": (_lying_size, r"bytes after small\.txt that are no tar member"),
    "huge-declared-size": (_huge_declared, r"more than 1 MB of files \(at bomb\.bin\)"),
    "hidden-after-the-end": (_hidden_after_the_end, r"bytes after ok\.txt that are no tar member"),
    "duplicate-then-symlink": (lambda: _tar(_file("f"), _info("f", tarfile.SYMTYPE, link="g")), r"holds f twice"),
    "pax-rename": (lambda: _tar(_file("innocent.txt", pax={"path": "evil.txt"})),
                   r"member 'innocent\.txt' is renamed to 'evil\.txt' by an extended header"),
    "pax-rename-out": (lambda: _tar(_file("innocent.txt", pax={"path": "../evil.txt"})), r"innocent\.txt"),
    "pax-link-rename": (lambda: _tar(_info("l", tarfile.SYMTYPE, link="ok", pax={"linkpath": "/etc/shadow"})),
                        r"member 'l' has its link target 'ok' changed to '/etc/shadow' by an extended header"),
    "pax-global-rename": (lambda: _global_rename(), r"global pax header that renames"),
    "gnu-longname-rename": (_gnu_longname_rename, r"'innocent\.txt' is renamed to 'evil\.txt'"),
    "nul-in-name": (lambda: _tar(_file("a.txt", pax={"path": "a\0/../../x" + "y" * 120})), r"NUL byte"),
    "negative-size": (_negative_size, r"member neg\.bin declares a size of -1 bytes"),
    "directory-with-data": (_directory_with_data, r"member d declares a size of 512 bytes"),
    "long-link-target": (lambda: _tar(_info("l", tarfile.SYMTYPE, link="a/" * 2500)), r"symlink l -> .* has a target longer than 4095 bytes"),
    "too-deep": (lambda: _tar(_file("d/" * 300 + "x")), r"is longer or deeper than a path may be here"),
    "name-too-long": (lambda: _tar(_file("n" * 256)), r"is longer or deeper than a path may be here"),
    "not-a-tar": (lambda: b"PK\x03\x04" + b"\0" * 2000, r"is not a tar|no tar member|damaged"),
    "gzip": (lambda: b"\x1f\x8b\x08\0" + b"\x01" * 2000, r"is not a tar|no tar member|damaged"),
}


def _global_rename() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"path": "../g"}) as tar:
        data = b"x"
        tar.addfile(_info("a.txt", size=1), io.BytesIO(data))
    return buffer.getvalue()


def _snapshot(root: Path) -> dict[str, tuple[int, bytes | str | None]]:
    """Everything under `root`: its kind/mode and content (files), target (links)."""
    seen: dict[str, tuple[int, bytes | str | None]] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder, name)
            status = path.lstat()
            content = os.readlink(path) if path.is_symlink() else path.read_bytes() if path.is_file() else None
            seen[str(path.relative_to(root))] = (status.st_mode, content)
    return seen


@pytest.fixture
def box(tmp_path):
    """A folder holding a sentinel and the destination (empty), as a host's env root would."""
    root = tmp_path / "box"
    (root / "dest").mkdir(parents=True)
    (root / "sentinel").write_text("untouched\n")
    (root / "elsewhere").mkdir()
    return root


def _assert_nothing_outside(box: Path, before: dict) -> None:
    after = {k: v for k, v in _snapshot(box).items() if not k.startswith("dest")}  # dest, dest2, ...
    assert after == {k: v for k, v in before.items() if not k.startswith("dest")}
    assert (box / "sentinel").read_text() == "untouched\n"
    assert not os.path.lexists(PWNED) and not os.path.lexists(PWNED_ETC)
    assert not os.path.lexists(box.parent / "x") and not os.path.lexists(box / "x")
    assert not os.path.lexists(box.parent / "evil.txt") and not os.path.lexists(box / "evil.txt")


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_hostile_archive_is_refused_and_touches_nothing_outside(box, attack):
    make, message = ATTACKS[attack]
    tar = make()
    before = _snapshot(box)
    with pytest.raises(ArchiveError, match=message) as refused:
        extract(tar, box / "dest", LIMITS)
    assert "\n" not in str(refused.value)
    _assert_nothing_outside(box, before)
    assert list((box / "dest").iterdir()) == []  # refused before a single byte is written


def test_the_same_checks_guard_reading_a_manifest():
    with pytest.raises(ArchiveError, match="leads outside"):
        manifest_of(_tar(_info("a", tarfile.SYMTYPE, link="/")))


def test_a_destination_that_is_not_empty_is_refused(box):
    (box / "dest/already").write_text("x")
    with pytest.raises(ArchiveError, match="is not empty"):
        extract(_tar(_file("already")), box / "dest", LIMITS)
    assert (box / "dest/already").read_text() == "x"


def test_a_link_swapped_into_the_destination_is_never_followed(box):
    """A destination someone else changes while it is written: a directory swapped for a link to
    the outside between two members. The write fails; the outside is untouched."""
    tar = _tar(_info("d", tarfile.DIRTYPE), _file("d/x"))
    real_mkdir = os.mkdir

    def swap(path, mode=0o777, *, dir_fd=None):
        real_mkdir(path, mode, dir_fd=dir_fd)
        if path == "d" and dir_fd is not None:
            os.rmdir(path, dir_fd=dir_fd)
            os.symlink(str(box / "elsewhere"), path, dir_fd=dir_fd)

    before = _snapshot(box)
    os.mkdir = swap
    try:
        with pytest.raises(ArchiveError, match="cannot unpack d"):
            extract(tar, box / "dest", LIMITS)
    finally:
        os.mkdir = real_mkdir
    _assert_nothing_outside(box, before)


def test_suid_and_sgid_bits_are_dropped(box):
    extract(_tar(_file("tool", b"#!/bin/sh\n", mode=0o6755), _info("d", tarfile.DIRTYPE, mode=0o1777)),
            box / "dest", LIMITS)
    assert (box / "dest/tool").stat().st_mode & 0o7777 == 0o755
    assert (box / "dest/d").stat().st_mode & 0o7777 == 0o777


def test_a_read_only_directory_is_filled_before_its_mode_is_set(box):
    extract(_tar(_info("ro", tarfile.DIRTYPE, mode=0o555), _file("ro/x")), box / "dest", LIMITS)
    assert (box / "dest/ro/x").read_text() == "pwned\n"
    assert (box / "dest/ro").stat().st_mode & 0o777 == 0o555


def test_long_and_unicode_names_in_pax_headers_are_taken(box):
    long = "/".join(["d" * 60] * 4) + "/file.txt"
    extract(_tar(_file(long, b"long\n"), _file("héllo.txt", b"hi\n")), box / "dest", LIMITS)
    assert (box / "dest" / long).read_text() == "long\n"
    assert (box / "dest/héllo.txt").read_text() == "hi\n"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_chain_of_40_links_is_taken_and_many_links_resolve_quickly(box):
    assert extract(_link_chain(40), box / "dest", LIMITS)["l0"].target == "l1"
    assert (box / "dest/l0").read_text() == "pwned\n"  # the kernel follows 40 too
    # 200 chains of 30 links through 30 directories each: every link is resolved once, not per chain
    many = _tar(*(_info(f"c{c}/d{i}/up", tarfile.SYMTYPE, link=f"../d{i + 1}/up" if i < 29 else "../../c0")
                  for c in range(200) for i in range(30)))
    (box / "dest2").mkdir()
    assert len(extract(many, box / "dest2", LIMITS)) == 200 * 30


def test_links_that_loop_lead_nowhere_and_are_taken(box):
    """A loop, or a chain past the kernel's 40, resolves nowhere (ELOOP): as harmless as a broken
    link, and a user's folder may hold one."""
    before = _snapshot(box)
    loops = _tar(_info("l1", tarfile.SYMTYPE, link="l2/x"), _info("l2", tarfile.SYMTYPE, link="l1/x"),
                 _info("self", tarfile.SYMTYPE, link="self"))
    assert set(extract(loops, box / "dest", LIMITS)) == {"l1", "l2", "self"}
    (box / "dest2").mkdir()
    extract(_link_chain(41), box / "dest2", LIMITS)
    with pytest.raises(OSError, match="Too many levels of symbolic links"):
        (box / "dest2/l0").read_text()
    _assert_nothing_outside(box, before)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_git_archive_with_a_very_long_path_is_taken(tmp_path):
    """git writes `<sha>.data` in the ustar name and the path in a pax header when it cannot split it."""
    repo = tmp_path / "repo"
    long = "x" * 150 + ".txt"
    (repo / "sub").mkdir(parents=True)
    (repo / "sub" / long).write_text("long\n")
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(tmp_path), "GIT_AUTHOR_NAME": "t",
           "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "one"]):
        subprocess.run(["git", *argv], cwd=repo, env=env, check=True)
    tar = subprocess.run(["git", "archive", "HEAD"], cwd=repo, env=env, check=True, capture_output=True).stdout
    (tmp_path / "dest").mkdir()
    extract(tar, tmp_path / "dest", LIMITS)
    assert (tmp_path / "dest/sub" / long).read_text() == "long\n"


def test_apply_delta_refuses_a_hostile_checkpoint_whole_or_path_by_path(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    before = _snapshot(tmp_path)
    with pytest.raises(ArchiveError, match="member a/x lies under a, which is a symlink"):
        apply_delta(folder, {}, Checkpoint(base="e", added=["a", "a/x"]),
                    _tar(_info("a", tarfile.SYMTYPE, link=str(tmp_path)), _file("a/x")))
    assert _snapshot(tmp_path) == before
    report = apply_delta(folder, {}, Checkpoint(base="e", added=["etc", "up"]),
                         _tar(_info("etc", tarfile.SYMTYPE, link="/etc"), _info("up", tarfile.SYMTYPE, link="..")))
    assert report.refused == [("etc", f"the symlink leads outside {folder}"), ("up", f"the symlink leads outside {folder}")]
    assert _snapshot(tmp_path) == before


def test_apply_delta_refuses_hostile_deleted_paths(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    (tmp_path / "victim").write_text("keep\n")
    with pytest.raises(ArchiveError, match=r"`\.\.` component"):
        apply_delta(folder, {}, Checkpoint(base="e", deleted=["../victim"]), None)
    assert (tmp_path / "victim").read_text() == "keep\n"


# ---- as an unprivileged user ---------------------------------------------------------------------

_AS_NOBODY = """
import json, sys
from pathlib import Path
from toolq.workers.environments.archive import ArchiveError, Limits, extract
results = {}
for path in sorted(Path(sys.argv[1]).glob("*.tar")):
    dest = Path(sys.argv[1], path.stem + ".dest")
    dest.mkdir()
    try:
        extract(path.read_bytes(), dest, Limits(max_bytes=1 << 20, max_files=100_000))
        results[path.stem] = "extracted"
    except ArchiveError as e:
        results[path.stem] = "refused: " + str(e)
print(json.dumps(results))
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to become nobody")
def test_hostile_archives_are_refused_as_nobody_too(request):
    work = Path(tempfile.mkdtemp(prefix="toolq-hostile-"))  # pytest's tmp_path is closed to nobody
    request.addfinalizer(lambda: shutil.rmtree(work, ignore_errors=True))
    (work / "sentinel").write_text("untouched\n")
    os.chmod(work, 0o755)
    quick = {k: v for k, v in ATTACKS.items() if k != "too-many-files"}
    for name, (make, _) in quick.items():
        (work / f"{name}.tar").write_bytes(make())
    shutil.chown(work, 65534, 65534)
    before = _snapshot(work)
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", _AS_NOBODY,
                           str(work)], capture_output=True, text=True, cwd="/")
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert set(results) == set(quick)
    for name, (_, message) in quick.items():
        assert results[name].startswith("refused: ") and re.search(message, results[name].removeprefix("refused: ")), (name, results[name])
    after = {k: v for k, v in _snapshot(work).items() if ".dest" not in k}
    assert after == {k: v for k, v in before.items() if ".dest" not in k}
    assert all(not any(p.iterdir()) for p in work.glob("*.dest"))
    assert not os.path.lexists(PWNED) and not os.path.lexists(PWNED_ETC)


def test_a_checkpoint_of_what_hostile_commands_left_reads_nothing_outside_and_never_blocks(tmp_path):
    """Checkpoints read what the model's commands wrote: FIFOs (an open would block), sockets,
    links out of the environment or looping. None is followed or opened; each is said, not carried."""
    env = tmp_path / "env"
    env.mkdir()
    os.mkfifo(env / "pipe")
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(env / "sock"))
    (env / "loop").symlink_to("loop")
    (env / "shadow").symlink_to("/etc/shadow")
    (env / "etc").symlink_to("/etc")
    (env / "ok.txt").write_text("ok\n")
    try:
        delta = tree_delta({}, env, limits=LIMITS)
    finally:
        server.close()
    assert delta.added == ["loop", "ok.txt"] and set(delta.entries) == {"loop", "ok.txt"}  # a loop leads nowhere
    assert sorted(delta.skipped) == ["etc (a symlink that leads outside: not carried)",
                                     "pipe",
                                     "shadow (a symlink that leads outside: not carried)", "sock"]
    assert b"root:" not in (delta.tar or b"")
