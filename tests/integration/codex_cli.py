"""The real Codex CLI 0.171.0 for the exec-server tests: installed from npm once into
~/.cache/toolq-tests (reused after; the test is skipped in one line where npm cannot install it),
run as `codex exec` on the fake model with a CODEX_HOME of its own outside /tmp (Codex refuses to
make its helper binaries under a temp dir), its commands sent to an exec-server
(`CODEX_EXEC_SERVER_URL=ws://...`, or `$CODEX_HOME/environments.toml`).

What the model saw is what these tests assert on: each call's output text in the fake model's
last request (as the reference recordings' tool_outputs.txt).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from toolq.dev.bench import codex as reference
from toolq.dev.bench.exec_server import outputs
from toolq.dev.fake_model.server import FakeModel


def codex_or_skip() -> str:
    """The native `codex` binary (installed by npm the first time), or the test skipped in one line."""
    try:
        path = reference.install()
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (reference.CodexFailed, OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"Codex {reference.VERSION} cannot run here: {' '.join(str(e).split())[:200]}")
    if done.returncode != 0 or reference.VERSION not in done.stdout:
        pytest.skip(f"Codex {reference.VERSION} cannot run here: `codex --version` said {done.stdout.strip()!r}")
    return path


@dataclass
class Turn:
    """A `codex exec` that ran (or runs) one scripted turn."""
    fake: FakeModel
    proc: subprocess.Popen[str] | None = None
    stdout: str = ""
    stderr: str = ""
    requests: list[dict[str, Any]] = field(default_factory=list)

    @property
    def said(self) -> dict[str, str]:
        """call id -> the output text the model saw for it."""
        return outputs(self.fake.requests[-1]) if self.fake.requests else {}

    def why(self) -> str:
        """For an assertion's message: what Codex printed and what the model saw."""
        return f"codex exit {self.proc and self.proc.returncode}\nstderr: {self.stderr[-3000:]}\nsaid: {self.said}"


@contextmanager
def running(codex: str, script: list[Any], workspace: Path, *, url: str | None = None,
            environments: str | None = None, prompt: str = "go") -> Iterator[Turn]:
    """`codex exec -C workspace` started on a fake model serving `script`; its commands go to the
    exec-server at `url` (or the one `environments`, the text of environments.toml, names). The
    block sees it running; at the end it is waited for (killed if still there after 120 s)."""
    env = {"CODEX_EXEC_SERVER_URL": url} if url else {}
    with ExitStack() as stack:
        fake = stack.enter_context(FakeModel(script))
        cx = stack.enter_context(reference.codex(codex, fake.base_url, sandboxed=False, env=env,
                                                 environments=environments))
        proc = subprocess.Popen(cx.argv(str(workspace), prompt), env=cx.environ(), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        turn = Turn(fake, proc)
        try:
            yield turn
        finally:
            try:
                turn.stdout, turn.stderr = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                turn.stdout, turn.stderr = proc.communicate()
            turn.requests = list(fake.requests)


def turn(codex: str, script: list[Any], workspace: Path, **kw: Any) -> Turn:
    """Run one scripted `codex exec` turn to its end (see `running`)."""
    with running(codex, script, workspace, **kw) as t:
        pass
    return t


def environments_toml(program: str, args: list[str], env: dict[str, str]) -> str:
    """environments.toml for an exec-server Codex starts itself over stdio."""
    def q(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
    lines = ['default = "toolq"', "include_local = false", "", "[[environments]]", 'id = "toolq"',
             f"program = {q(program)}", f"args = [{', '.join(q(a) for a in args)}]", 'cwd = "/"', "",
             "[environments.env]", *(f"{k} = {q(v)}" for k, v in env.items())]
    return "\n".join(lines) + "\n"
