"""Issue 24 item 4, as the attacker would: root's private files.

A root worker's command is the host's uid 0 without capabilities, and uid 0 still owns root's
files: every 0600 file under /etc, /opt and /usr that was not masked was readable (TLS keys,
WireGuard and Kubernetes configs, keytabs, an MCP config with its `env` values). Now /etc is
exposed by an allowlist, and beneath the read directories what other users may not read is
hidden. Private files are made in the set-up (and removed after), owned by the worker's user (root,
or `nobody` for an unprivileged worker: its own keys are no more the model's than root's are),
the workers start, and the model tries to read them every way it can; ordinary programs must
still work. The commands of a root worker still run as uid 0 (docs/security.md says why): the
control checks that too, so a change there is seen.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

import pytest

from tests.integration import unprivileged
from tests.integration.test_hostile_exec import attack, hostile_workers, locked_redis  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

TAG = f"toolq-test-{secrets.token_hex(4)}"
SECRET = f"private-{secrets.token_hex(8)}"
PLACES = (Path(f"/etc/{TAG}.key"), Path(f"/etc/{TAG}.d/token"), Path(f"/opt/{TAG}/secret.conf"),
          Path(f"/opt/{TAG}/closed/inner"), Path(f"/usr/local/share/{TAG}-secret"), Path(f"/usr/share/{TAG}-secret"),
          Path(f"/usr/lib/{TAG}/keytab"))
#: Entries of /etc the operator adds (TOOLQ_SANDBOX_ETC) that are links: to a file everyone may
#: read it works, to a private one it is no way around the rule.
OPEN_LINK, PRIVATE_LINK = Path(f"/etc/{TAG}-open.conf"), Path(f"/etc/{TAG}-private.conf")
LINKS = {OPEN_LINK: Path(f"/opt/{TAG}/open"), PRIVATE_LINK: Path(f"/usr/local/share/{TAG}-secret")}


def make_private_files(owner: int) -> list[Path]:
    """PLACES (mode 0600, `owner`'s) and LINKS; what was made, to remove."""
    made: list[Path] = []
    for path in PLACES:
        for parent in reversed(path.parents):
            if not parent.exists():
                parent.mkdir(mode=0o755)
                made.append(parent)
        path.write_text(SECRET + "\n")
        path.chmod(0o600)
        made.append(path)
    Path(f"/opt/{TAG}/open").write_text("OPEN-CONTENT\n")
    made.append(Path(f"/opt/{TAG}/open"))
    Path(f"/opt/{TAG}/closed").chmod(0o700)  # a private folder whose file's own mode is open
    Path(f"/opt/{TAG}/closed/inner").chmod(0o644)
    for link, target in LINKS.items():
        link.symlink_to(target)
        made.append(link)
    for path in made:
        os.lchown(path, owner, -1)
    return made


@pytest.fixture(scope="module", params=[("bwrap", "1", False), ("bwrap", "0", False), ("landlock", "1", False),
                                        ("bwrap", "1", True), ("landlock", "1", True)],
                ids=["bwrap-cells-root", "bwrap-per-command-root", "landlock-root", "bwrap-cells-user", "landlock-user"])
def files_worker(request, locked_redis, tmp_path_factory):  # noqa: F811 - the fixture above
    """A worker started after its user's private files were made (it looks for them as it starts)."""
    backend, cells, user = request.param
    if os.geteuid() != 0:
        pytest.skip("making private files under /etc, /opt and /usr needs root")
    if user and (why := unprivileged.unavailable()):
        pytest.skip(f"no unprivileged worker here: {why}")
    made = make_private_files(unprivileged.ids()[0] if user else 0)
    try:
        yield from hostile_workers(backend, locked_redis, tmp_path_factory, user=user, TOOLQ_SANDBOX_CELLS=cells,
                                   TOOLQ_SANDBOX_ETC=",".join(link.name for link in LINKS))
    finally:
        for path in reversed(made):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def test_private_files_are_not_readable_and_programs_still_work(drive, files_worker, tmp_path):
    ws = files_worker.workspace(tmp_path)
    reads = {f"call_cat{i}": f"cat {path} 2>&1; cat /proc/self/root{path} 2>&1; cat /proc/1/root{path} 2>&1"
             for i, path in enumerate(PLACES)}
    out = attack(drive, files_worker, ws, {
        **reads,
        "call_links": f"cat {OPEN_LINK} {PRIVATE_LINK} 2>&1; echo",
        "call_grep": f"grep -rs {SECRET[:12]} /etc /usr/local /opt/{TAG} 2>/dev/null; echo",
        # Every file under the three trees that other users may not read but this command may: read it.
        "call_find": "find /etc /opt /usr ! -perm -0004 -type f -readable -print 2>/dev/null | "
                     "while read -r f; do cat \"$f\"; done 2>/dev/null | grep -ao 'private-[0-9a-f]*'; echo",
        "call_control": "id -u; getent passwd root && python3 -c \"import ssl; ssl.create_default_context(); "
                        "print('SSL-OK')\" && git --version && date +%Z && ls /etc/ssl/certs | head -1 && "
                        "readlink -e /etc/localtime",
    })
    code, control = out["call_control"]
    assert code == 0 and "SSL-OK" in control and "root:x:0:0" in control and "zoneinfo" in control, control
    # The command runs as the worker's uid, a root worker's too: what protects root's files is
    # that they are not in the sandbox, not who the command is.
    assert control.splitlines()[0] == str(os.stat(PLACES[0]).st_uid), control
    for call_id, (_, body) in out.items():
        assert SECRET not in body, (call_id, body)
    assert "OPEN-CONTENT" in out["call_links"][1]  # a link to a file everyone may read still works


def test_the_root_only_files_of_proc_are_covered(drive, files_worker, tmp_path):
    # timer_list, slabinfo, vmallocinfo...: mode 0400, and the kernel asks uid 0 for no capability
    # to read most of them (kernel addresses and allocator state, what an exploit looks for).
    if files_worker.backend == "landlock" and not files_worker.user:
        pytest.xfail("Landlock grants /proc as a whole: a root worker's command still reads them (docs/security.md)")
    from toolq.workers.isolation.cell_init import private_proc_files

    private = private_proc_files()
    assert private, "this kernel has no root-only file at the top of /proc"
    ws = files_worker.workspace(tmp_path)
    out = attack(drive, files_worker, ws, {"call_proc": "for f in " + " ".join(private) + "; do "
                                                        "echo \"$f $(cat \"$f\" 2>/dev/null | wc -c)\"; done; echo END",
                                           "call_control": "head -c 20 /proc/version && ls /proc/self/fd >/dev/null && echo OK"})
    code, body = out["call_proc"]
    read = dict(line.rsplit(" ", 1) for line in body.splitlines() if line.startswith("/proc/"))
    assert code == 0 and sorted(read) == private and set(read.values()) == {"0"}, body  # not one byte of any
    assert "Linux" in out["call_control"][1] and "OK" in out["call_control"][1], out["call_control"]
