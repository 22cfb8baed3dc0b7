"""What a sandboxed command may see and use: the policy every backend enforces.

One policy per worker, from its settings. The environment is an allowlist: a command never sees
the broker URL, API keys or Flower credentials, whatever the operator adds.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
import os
import re
import stat
import sys
from dataclasses import dataclass, field
from typing import Literal

from toolq.core.errors import ConfigurationError
from toolq.core.settings import Settings

Backend = Literal["bwrap", "landlock", "none"]

#: Variables a command keeps from the worker's environment (exact names or `*` patterns).
BASE_ENV = ("PATH", "LANG", "LANGUAGE", "LC_*", "TERM", "TZ", "USER", "LOGNAME", "SHELL",
            "PAGER", "GIT_PAGER", "MANPAGER", "LESS", "NO_COLOR")
#: Never passed, even when the operator names them: the fleet's credentials and toolq's own settings,
#: the OTLP exporter's headers (a tracing vendor's API key) and the worker's metrics directory.
FORBIDDEN_ENV = ("REDIS_URL", "CELERY_*", "TOOLQ_*", "OPENAI_*", "FLOWER_*", "OTEL_EXPORTER_OTLP*_HEADERS",
                 "PROMETHEUS_MULTIPROC_DIR")
#: Keep tools non-interactive: no pagers waiting for a key, no colour codes in the output.
ENV_OVERRIDES = {"PAGER": "cat", "GIT_PAGER": "cat", "NO_COLOR": "1", "TERM": "dumb"}
#: Directories every command may read (and execute from), when they exist. /etc is not among
#: them: only `ETC` of it is (a root worker's command, uid 0 without capabilities, still owns
#: every root-only file there: TLS keys, keytabs, cluster configs).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt", "/nix/store")
#: What of /etc commands see: what the C library, shells, git, Python, Node, compilers and TLS
#: clients read. More with TOOLQ_SANDBOX_ETC (names under /etc).
ETC = ("passwd", "group", "hosts", "host.conf", "hostname", "resolv.conf", "nsswitch.conf", "gai.conf", "protocols",
       "services", "networks", "rpc", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "ld.so.preload", "localtime",
       "timezone", "zoneinfo", "locale.alias", "locale.conf", "locale.gen", "default/locale", "os-release",
       "lsb-release", "debian_version", "alternatives", "environment", "profile", "profile.d", "bash.bashrc",
       "shells", "inputrc", "login.defs", "mime.types", "magic", "mailcap", "terminfo", "gitconfig",
       "ssl/certs", "ssl/openssl.cnf", "ca-certificates", "ca-certificates.conf", "pki/tls/certs",
       "pki/ca-trust/extracted", "crypto-policies/back-ends", "python3", "python3.11", "python3.12", "perl",
       "fonts", "java-17-openjdk", "xdg", "pip.conf", "npmrc", "wgetrc", "vimrc", "vim", "papersize")
#: The read directories where private files are found: searched once per worker for what other
#: users may not read (hidden from commands, see `private_entries`). /usr (with /usr/local) and
#: /opt: the operator's software and keys live there beside the system's; /bin, /lib... are
#: links into /usr on current systems.
SITE_DIRS = ("/opt", "/usr")
#: How many entries of `SITE_DIRS` are searched at most (about 0.5 s for /usr's 141,000 here).
SITE_SCAN_LIMIT = 1_000_000


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
    worker_processes: int = 0
    """All of the session host's commands and sessions together (0: no such bound)."""
    worker_memory_mb: int = 0
    worker_cpus: float = 0.0
    """A CFS quota over all of them, in CPUs (0: none)."""
    conversation_processes: int = 0
    """One conversation's commands and sessions together (0: no such bound)."""
    conversation_memory_mb: int = 0


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
    etc: tuple[str, ...] = field(default_factory=tuple)
    """The entries of /etc a command sees (`ETC` and TOOLQ_SANDBOX_ETC, those that exist)."""
    hidden: tuple[str, ...] = field(default_factory=tuple)
    """Beneath `read_dirs`, what other users may not read (`private_entries`): never readable."""

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
        bad = [n for n in s.sandbox_etc if os.path.isabs(n) or ".." in n.split("/")]
        if bad:
            raise ConfigurationError(f"invalid setting sandbox_etc (TOOLQ_SANDBOX_ETC): {', '.join(bad)}: give names "
                                     "under /etc, such as ssh/ssh_config")
        etc = tuple(p for p in dict.fromkeys(f"/etc/{n.strip('/')}" for n in (*ETC, *s.sandbox_etc))
                    if os.path.lexists(p) and (not os.path.islink(p) or _world_readable(os.path.realpath(p))))
        site = tuple(d for d in SITE_DIRS if any(d == r or d.startswith(r + "/") for r in read))
        return cls(requested=s.sandbox, network=s.sandbox_network, extra_env=tuple(s.sandbox_env),
                   cells=s.sandbox_cells, read_dirs=tuple(dict.fromkeys(read)), etc=etc, hidden=private_entries(site),
                   limits=Limits(s.sandbox_memory_mb, s.sandbox_processes, s.sandbox_cpu_seconds, s.sandbox_file_mb,
                                 s.sandbox_worker_processes, s.sandbox_worker_memory_mb, s.sandbox_worker_cpus,
                                 s.sandbox_conversation_processes, s.sandbox_conversation_memory_mb))

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


def _world_readable(path: str) -> bool:
    """Whether other users may read `path` and reach it (every folder above searchable): where an
    allowlisted /etc entry that is a link leads must be, or it would be a way around the rule."""
    try:
        if not os.stat(path).st_mode & stat.S_IROTH:
            return False
        parent = os.path.dirname(path)
        while parent != "/":
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
            parent = os.path.dirname(parent)
    except OSError:
        return False
    return True


@functools.lru_cache(maxsize=8)
def private_entries(dirs: tuple[str, ...]) -> tuple[str, ...]:
    """Beneath `dirs`, the topmost files and directories that other users may not read (what their
    owner kept private: a root worker's command, uid 0 without capabilities, would still read
    root's). Symlinks are not followed. Once per worker, at most SITE_SCAN_LIMIT entries: scandir
    and one lstat an entry (os.walk stats each entry twice and took three times as long)."""
    found: list[str] = []
    pending, seen = list(dirs), 0
    while pending and seen <= SITE_SCAN_LIMIT:
        try:
            entries = os.scandir(pending.pop())
        except OSError:
            continue  # unreadable to this worker: then to its commands too
        with entries:
            for entry in entries:
                seen += 1
                try:
                    mode = entry.stat(follow_symlinks=False).st_mode
                except OSError:
                    continue
                if stat.S_ISLNK(mode):
                    continue
                if not mode & stat.S_IROTH or (stat.S_ISDIR(mode) and not mode & stat.S_IXOTH):
                    found.append(entry.path)
                elif stat.S_ISDIR(mode):
                    pending.append(entry.path)
    if pending:
        logging.getLogger("toolq.worker").warning(
            "sandbox: stopped looking for private files after %d entries of %s: beneath %s and %d more folders, "
            "files other users may not read are not hidden from commands", SITE_SCAN_LIMIT, ", ".join(dirs),
            pending[-1], len(pending) - 1)
    return tuple(sorted(found))
