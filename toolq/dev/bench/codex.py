"""The reference, measured in the same run: the real Codex CLI (`codex exec` 0.171.0, the version the
reference figures come from, docs/reference/codex-behaviour.md#timing) against the same kind of
fake model, when it is installed here.

Found through TOOLQ_BENCH_CODEX (a path), `codex` on PATH, or the copy `install()` put in
~/.cache/toolq-tests (the tests' set-up and `toolq bench exec-server` install it there with npm);
`npm install -g @openai/codex@0.171.0` installs it too (the npm wrapper is skipped for the native
binary it would start, so node's start-up is not counted against Codex). Without it the benchmarks
compare with the reference's fixed figures and say so.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

VERSION = "0.171.0"
INSTALL = f"npm install -g @openai/codex@{VERSION}"
#: The slug that gets Codex's classic `tools` (exec_command); its default model runs in code mode.
MODEL = "gpt-5.5"
#: Codex's shell snapshot is ready about 0.8 s into a session: the reference's warm-up step.
WARM_UP_CMD = "sleep 1.5"


#: Where `install()` puts Codex: outside the temp dir, reused by every later run.
CACHE = Path.home() / ".cache" / "toolq-tests" / f"codex-{VERSION}"


def binary() -> str | None:
    """The native `codex` executable, or None (none installed, or only npm's wrapper). Without
    TOOLQ_BENCH_CODEX or `codex` on PATH, the copy `install()` made, if any."""
    found = os.environ.get("TOOLQ_BENCH_CODEX") or shutil.which("codex")
    if not found:
        return native_in(CACHE)
    if not os.access(found, os.X_OK):
        return None
    path = Path(found).resolve()
    with path.open("rb") as f:
        script = f.read(2) == b"#!"
    if script:  # npm's node wrapper: the binary is in a platform package beside it
        natives = [*sorted(path.parents[2].glob("codex-linux-*/vendor/*/bin/codex")),
                   *sorted(path.parents[1].glob("vendor/*/codex/codex"))]
        if not natives:
            return None
        path = natives[0]
    return str(path) if os.access(path, os.X_OK) else None


class CodexFailed(Exception):
    """Codex could not run the benchmark's turn here (its sandbox, say); the message says why."""


def native_in(prefix: Path) -> str | None:
    """The native binary an `npm install --prefix PREFIX @openai/codex` put there, or None."""
    found = sorted(prefix.glob("node_modules/@openai/codex-linux-*/vendor/*/bin/codex"))
    return str(found[0]) if found and os.access(found[0], os.X_OK) else None


def install(prefix: Path = CACHE, timeout: float = 180) -> str:
    """The native binary of `@openai/codex@VERSION` under `prefix`, installed there with npm the
    first time (about 9 s; one installer at a time). Raises `CodexFailed` in one line where npm is
    missing or cannot install it (no registry reachable, say)."""
    if found := native_in(prefix):
        return found
    npm = shutil.which("npm")
    if npm is None:
        raise CodexFailed(f"npm is not installed, so Codex {VERSION} cannot be")
    prefix.mkdir(parents=True, exist_ok=True)
    with (prefix / ".install.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if found := native_in(prefix):  # another process installed it while we waited
            return found
        argv = [npm, "install", "--no-audit", "--no-fund", "--prefix", str(prefix), f"@openai/codex@{VERSION}"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise CodexFailed(f"npm install @openai/codex@{VERSION} took over {timeout:.0f} s (no registry?)") from None
        if done.returncode != 0:
            said = [line for line in done.stderr.splitlines() if line.strip()]
            raise CodexFailed(f"npm install @openai/codex@{VERSION} failed: {said[-1] if said else done.returncode}")
    if found := native_in(prefix):
        return found
    raise CodexFailed(f"npm installed @openai/codex@{VERSION} without a native binary for this machine")


def describe(path: str | None) -> str:
    return f"Codex {VERSION} ({path})" if path else f"Codex is not installed ({INSTALL}); its fixed figures"


class Codex:
    """`codex exec` on one fake model, with its own fresh CODEX_HOME, sandboxed as the flag says:
    `workspace-write` (Codex's own bubblewrap sandbox) or none (`--dangerously-bypass-...`, how
    the reference figures were measured)."""

    def __init__(self, path: str, home: Path, *, sandboxed: bool, env: dict[str, str] | None = None) -> None:
        self.path, self.home, self.sandboxed = path, home, sandboxed
        self.env = dict(env or {})
        """Set for every `codex exec` on top of ours (`CODEX_EXEC_SERVER_URL`, say)."""

    def argv(self, workspace: str, prompt: str) -> list[str]:
        bypass = [] if self.sandboxed else ["--dangerously-bypass-approvals-and-sandbox"]
        return [self.path, "exec", "--skip-git-repo-check", *bypass, "--json", "-C", workspace, prompt]

    def environ(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("OPENAI_API_KEY", "CODEX_EXEC_SERVER_URL")}
        env.update(CODEX_HOME=str(self.home), FAKE_OPENAI_KEY="bench", **self.env)
        return env

    def exec(self, workspace: str, prompt: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Raises `CodexFailed` if it does not exit 0."""
        proc = subprocess.run(self.argv(workspace, prompt), env=self.environ(), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise CodexFailed(f"codex exec exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
        return proc


@contextmanager
def codex(path: str, base_url: str, *, sandboxed: bool, env: dict[str, str] | None = None,
          environments: str | None = None) -> Iterator[Codex]:
    """A Codex on `base_url` (the fake model's `/v1`). Its CODEX_HOME is not under the temp dir:
    there Codex refuses to make the helper its sandbox starts (`codex-linux-sandbox`). `env`: set
    for each `codex exec` (`CODEX_EXEC_SERVER_URL=ws://...`: its commands run on that exec-server);
    `environments`: the text of `$CODEX_HOME/environments.toml` (an exec-server over stdio, say)."""
    parent = Path.home() / ".cache" / "toolq-bench"
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=parent) as home:
        if environments is not None:
            (Path(home) / "environments.toml").write_text(environments)
        (Path(home) / "config.toml").write_text(
            f'model = "{MODEL}"\nmodel_provider = "fake"\napproval_policy = "never"\n'
            f'sandbox_mode = "{"workspace-write" if sandboxed else "danger-full-access"}"\n'
            "check_for_update_on_startup = false\n\n"
            f'[model_providers.fake]\nname = "Fake Responses"\nbase_url = "{base_url}"\n'
            'env_key = "FAKE_OPENAI_KEY"\nwire_api = "responses"\n')
        yield Codex(path, Path(home), sandboxed=sandboxed, env=env)
