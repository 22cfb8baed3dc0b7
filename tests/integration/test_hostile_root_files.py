"""Issue 24 item 4, as the attacker would: root's private files.

A root worker's command is the host's uid 0 without capabilities, and uid 0 still owns root's
files: every 0600 file under /etc, /opt and /usr that was not masked was readable (TLS keys,
WireGuard and Kubernetes configs, keytabs, an MCP config with its `env` values). Now /etc is
exposed by an allowlist, and beneath the read directories what other users may not read is
hidden. Root-owned private files are made in the set-up (and removed after), the workers start,
and the model tries to read them every way it can; ordinary programs must still work.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

import pytest

from tests.integration.test_hostile_exec import attack, hostile_workers, locked_redis  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

TAG = f"toolq-test-{secrets.token_hex(4)}"
SECRET = f"private-{secrets.token_hex(8)}"
PLACES = (Path(f"/etc/{TAG}.key"), Path(f"/etc/{TAG}.d/token"), Path(f"/opt/{TAG}/secret.conf"),
          Path(f"/opt/{TAG}/closed/inner"), Path(f"/usr/local/share/{TAG}-secret"))


@pytest.fixture(scope="module")
def private_files():
    if os.geteuid() != 0:
        pytest.skip("making root's private files needs root")
    made = []
    try:
        for path in PLACES:
            if not path.parent.exists():
                path.parent.mkdir(parents=True)
                made.append(path.parent)
            path.write_text(SECRET + "\n")
            path.chmod(0o600)
            made.append(path)
        Path(f"/opt/{TAG}").chmod(0o755)  # an open folder: only its file is private
        Path(f"/opt/{TAG}/closed").chmod(0o700)  # a private folder whose file's own mode is open
        Path(f"/opt/{TAG}/closed/inner").chmod(0o644)
        yield
    finally:
        for path in reversed(made):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


@pytest.fixture(scope="module", params=[("bwrap", "1"), ("bwrap", "0"), ("landlock", "1")],
                ids=["bwrap-cells", "bwrap-per-command", "landlock"])
def root_worker(request, private_files, locked_redis, tmp_path_factory):  # noqa: F811 - the fixture above
    backend, cells = request.param
    yield from hostile_workers(backend, locked_redis, tmp_path_factory, TOOLQ_SANDBOX_CELLS=cells)


def test_roots_private_files_are_not_readable_and_programs_still_work(drive, root_worker, tmp_path):
    reads = {f"call_cat{i}": f"cat {path} 2>&1; cat /proc/self/root{path} 2>&1" for i, path in enumerate(PLACES)}
    out = attack(drive, root_worker, tmp_path, {
        **reads,
        "call_find": f"grep -rs {SECRET[:12]} /etc /opt /usr/local 2>/dev/null; find / -xdev -name '{TAG}*' 2>/dev/null",
        "call_control": "id -u; getent passwd root && python3 -c \"import ssl; ssl.create_default_context(); "
                        "print('SSL-OK')\" && git --version && date +%Z && ls /etc/ssl/certs | head -1",
    })
    code, control = out["call_control"]
    assert code == 0 and "SSL-OK" in control and "root:x:0:0" in control, control
    assert control.splitlines()[0] == "0"  # a root worker's command: uid 0, yet none of root's secrets
    for call_id, (_, body) in out.items():
        assert SECRET not in body, (call_id, body)
