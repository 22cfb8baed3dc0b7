"""What a sandboxed command may see and use: the policy every backend enforces.

One policy per worker, from its settings. The environment is an allowlist: a command never sees
the broker URL, API keys or Flower credentials, whatever the operator adds.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Literal

from toolq.orchestrator.errors import ConfigurationError
from toolq.orchestrator.settings import Settings

Backend = Literal["bwrap", "landlock", "none"]

#: Variables a command keeps from the worker's environment (exact names or `*` patterns).
BASE_ENV = ("PATH", "LANG", "LANGUAGE", "LC_*", "TERM", "TZ", "USER", "LOGNAME", "SHELL",
            "PAGER", "GIT_PAGER", "MANPAGER", "LESS", "NO_COLOR")
#: Never passed, even when the operator names them: the fleet's credentials and toolq's own settings.
FORBIDDEN_ENV = ("REDIS_URL", "CELERY_*", "TOOLQ_*", "OPENAI_*", "FLOWER_*")
#: Keep tools non-interactive: no pagers waiting for a key, no colour codes in the output.
ENV_OVERRIDES = {"PAGER": "cat", "GIT_PAGER": "cat", "NO_COLOR": "1", "TERM": "dumb"}
#: Directories every command may read (and execute from), when they exist.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/nix/store")


def _matches(name: str, patterns: tuple[str, ...] | list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


@functools.lru_cache(maxsize=8)
def _pattern(patterns: tuple[str, ...]) -> re.Pattern[str]:
    """One regex for a list of `*` patterns (the environment is filtered on every call)."""
    return re.compile("|".join(fnmatch.translate(p) for p in patterns))


@dataclass(frozen=True)
class Limits:
    memory_mb: int
    processes: int
    cpu_seconds: int
    file_mb: int


@dataclass(frozen=True)
class Policy:
    requested: Literal["auto", "bwrap", "landlock", "none"]
    network: Literal["none", "host"]
    limits: Limits
    extra_env: tuple[str, ...] = ()
    cells: bool = True
    """bubblewrap: commands a session-host slot starts fork in a cell (`cell.py`)."""
    read_dirs: tuple[str, ...] = field(default_factory=tuple)
    """Readable besides the workspace: the system directories, this interpreter's prefix, and
    what the operator adds. The worker's home, logs and other workspaces are not among them."""

    @classmethod
    def from_settings(cls, s: Settings) -> Policy:
        bad = [n for n in s.sandbox_env if _matches(n, FORBIDDEN_ENV)]
        if bad:
            raise ConfigurationError(f"invalid setting sandbox_env (TOOLQ_SANDBOX_ENV): {', '.join(bad)} may "
                                     "hold a fleet credential and is never passed to a command")
        prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)}
        read = [d for d in SYSTEM_DIRS if os.path.lexists(d)]
        read += sorted(p for p in prefixes if not any(p == d or p.startswith(d + "/") for d in read))
        read += [os.path.abspath(p) for p in s.sandbox_read]
        return cls(requested=s.sandbox, network=s.sandbox_network, extra_env=tuple(s.sandbox_env), cells=s.sandbox_cells,
                   read_dirs=tuple(dict.fromkeys(read)),
                   limits=Limits(s.sandbox_memory_mb, s.sandbox_processes, s.sandbox_cpu_seconds, s.sandbox_file_mb))

    def command_env(self, source: dict[str, str], home: str, confined: bool = True) -> dict[str, str]:
        """The environment a command gets: the allowlist from `source`, then the overrides. When
        `confined`, HOME and TMPDIR point at the call's private temporary directory (the worker's
        home is hidden) and PATH keeps only the directories the command may read."""
        allowed, forbidden = _pattern((*BASE_ENV, *self.extra_env)), _pattern(FORBIDDEN_ENV)
        env = {k: v for k, v in source.items() if allowed.match(k) and not forbidden.match(k)}
        env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
        env.update(ENV_OVERRIDES)
        if confined:
            env["PATH"] = ":".join(p for p in env["PATH"].split(":") if self.readable(p)) or "/usr/bin:/bin"
            env["HOME"] = env["TMPDIR"] = home
        else:
            env["HOME"] = source.get("HOME", home)
        return env

    def readable(self, path: str) -> bool:
        return any(path == d or path.startswith(d.rstrip("/") + "/") for d in self.read_dirs)
