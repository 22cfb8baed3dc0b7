"""Separate hosts on one machine: Redis, the orchestrator and workers, each in its own network
namespace, joined by veth links to a bridge in a "switch" namespace (issue 27 item 2).

Nothing is added to the root namespace's network: the bridge, the links and the addresses
(10.213.X.0/24, X random per harness) live only inside the harness's namespaces. A worker host
also gets its own mount namespace with a private /tmp, and in the harness's directory sees only
its own folder (its log) and the workspace, the one folder the hosts share on purpose.

Faults need nothing but iproute2, since a machine may lack iptables, nft and tc's classifiers
(this project's CI VM does): a host is cut from another by a permanent neighbour entry naming a
MAC no host has, so its frames to that address are dropped silently on the bridge, as a
partitioned network drops them, while the other direction still flows (one-way loss); a cut both
ways sets the entry on both hosts. `heal()` puts the real addresses back. A slow link is tc's
`tbf` (`throttle`); delay and random loss use `tc netem`, where the kernel has it
(`netem_available()`).

Everything made is named `toolq-<pid>x<hex>-<role>`: `close()` (a context manager's exit, and
atexit) kills what runs in each namespace and deletes them, and `sweep_stale()` deletes those of
a harness whose process is dead (a test run SIGKILLed halfway). Needs root.

`python -m toolq.dev.hosts fake-model --script FILE --port P --record OUT` serves the fake model
inside a namespace and writes the request bodies it got to OUT when stopped (SIGTERM), so a test
can check every request's pairing.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolq.core import import_path
from toolq.core.libc import pid_exists
from toolq.local.embedded import ChildProcess, RedisServer, WorkerProcess, die_with_parent, wait_for

PREFIX = "toolq-"
#: `toolq-<owner pid>x<random>-<role>`: the owner's pid lets a later run sweep what a killed one left.
NAME_RE = re.compile(r"^toolq-(\d+)x([0-9a-f]{6})-([a-z0-9]+)$")
SWITCH = "switch"
#: A MAC no host of a harness has: a neighbour entry naming it drops that host's frames to the address.
NOWHERE_MAC = "02:00:5e:00:de:ad"
#: The harness's directory lives here, not in /tmp, which worker hosts do not share.
BASE_DIR = Path("/var/tmp")
NETNS_DIR = Path("/var/run/netns")
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=10)


def cannot_run() -> str | None:
    """Why the harness cannot run here (one line), or None."""
    if os.geteuid() != 0:
        return "the hosts harness needs root (network namespaces)"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "the hosts harness needs iproute2's `ip` and util-linux's `unshare`"
    probe = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}-probe"
    made = _ip("netns", "add", probe, check=False)
    _ip("netns", "del", probe, check=False)
    return None if made.returncode == 0 else f"cannot make a network namespace: {made.stderr.strip()}"


def netem_available() -> bool:
    """Whether the kernel has `tc netem` (tried on a throwaway namespace's loopback)."""
    if shutil.which("tc") is None:
        return False
    probe = f"{PREFIX}{os.getpid()}x{secrets.token_hex(3)}-netem"
    try:
        _ip("netns", "add", probe)
        tried = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                                "delay", "1ms"], capture_output=True, timeout=10)
        return tried.returncode == 0
    finally:
        _ip("netns", "del", probe, check=False)


def harness_namespaces() -> list[str]:
    """Every namespace named as a harness names them, whoever made it."""
    listed = _ip("netns", "list", check=False).stdout.splitlines()
    return [line.split()[0] for line in listed if line and NAME_RE.match(line.split()[0])]



def _delete_namespace(name: str) -> None:
    """Kill what still runs in it (a sandboxed command out of its worker's group), then delete it:
    its end of each veth goes with it, and so does the peer."""
    for pid in _ip("netns", "pids", name, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "del", name, check=False)


def sweep_stale() -> list[str]:
    """Delete the namespaces of harnesses whose process is dead; returns their names."""
    stale = [n for n in harness_namespaces() if not pid_exists(int(NAME_RE.match(n).group(1)))]  # type: ignore[union-attr]
    for name in stale:
        _delete_namespace(name)
    return stale


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns to a network namespace: {os.strerror(err)}")


@dataclass
class Host:
    role: str
    netns: str
    addr: str
    private: tuple[Path, list[Path]] | None = None
    """A worker host's files: (the harness's directory, the folders in it this host still sees)."""

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run on this host: in its network namespace (and its own files for a worker)."""
        if self.private is None:
            return ["ip", "netns", "exec", self.netns, *argv]
        mounts = ["unshare", "--mount", "--propagation", "private", "sh", "-c", self._mounts(*self.private), "sh"]
        return ["ip", "netns", "exec", self.netns, *mounts, *argv]

    @staticmethod
    def _mounts(hidden: Path, kept: list[Path]) -> str:
        """A shell script for a mount namespace of the host's own: an empty /tmp, and the harness's
        directory hidden under an empty tmpfs but for the folders kept. Each kept folder, and
        toolq's own files where they live under /tmp (a checkout cloned there, its venv), is bound
        aside before anything is covered, then moved back on top."""
        keep = [*kept, *_toolq_under_tmp()]
        stage = hidden / ".stage"
        q = shlex.quote
        lines = ["set -e"]
        lines += [f"mkdir -p {q(str(stage / str(k)))} && mount --bind {q(str(p))} {q(str(stage / str(k)))}"
                  for k, p in enumerate(keep)]
        lines.append("mount -t tmpfs -o mode=1777 tmpfs /tmp")
        lines += [f"mkdir /tmp/.keep{k} && mount --move {q(str(stage / str(k)))} /tmp/.keep{k}"
                  for k in range(len(keep))]
        lines.append(f"mount -t tmpfs -o mode=0700 tmpfs {q(str(hidden))}")
        lines += [f"mkdir -p {q(str(p))} && mount --move /tmp/.keep{k} {q(str(p))}" for k, p in enumerate(keep)]
        return "\n".join([*lines, 'exec "$@"'])


def _toolq_under_tmp() -> list[Path]:
    """What a worker host needs of this machine's /tmp to run toolq at all: the checkout and the
    Python installs it runs from, when they live there (CI clones into a temporary folder)."""
    here = Path(__file__).resolve().parents[2]
    found = {Path(p).resolve() for p in (here, sys.prefix, sys.base_prefix, sys.exec_prefix)}
    tmp = Path("/tmp")
    return sorted(p for p in found if p != tmp and tmp in p.parents)


class HostRedis(RedisServer):
    """A `redis-server` on a host's address (and its loopback), probed from inside its namespace."""

    def __init__(self, host: Host, workdir: Path, args: list[str] | None = None, port: int = 6379) -> None:
        super().__init__(port=port, workdir=workdir, args=args)
        self.host = host
        self.with_parent = True

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@{self.host.addr}:{self.port}/0"

    def config(self) -> str:
        return super().config().replace("bind 127.0.0.1", f"bind {self.host.addr} 127.0.0.1")

    def start(self) -> HostRedis:
        conf = self.dir / "redis.conf"
        conf.write_text(self.config())
        conf.chmod(0o600)
        self.proc = subprocess.Popen(self.host.wrap([self.binary or "redis-server", str(conf), *self.args]),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=self._preexec())
        wait_for(lambda: self._exited() or self.answers(), 10, f"redis on {self.host.netns}", self.dir / "redis.log")
        return self

    def answers(self) -> bool:
        return self.cli("ping").strip() == "PONG"

    def cli(self, *args: str) -> str:
        """`redis-cli` on the server's own host: the test process's namespace cannot reach it."""
        return redis_cli(self.host, self.port, self.password, *args)


def redis_cli(host: Host, port: int, password: str | None, *args: str) -> str:
    """`redis-cli` on `host` (the test process's namespace cannot reach it). The password goes in
    REDISCLI_AUTH, never on the command line, which every local process can read (helper-30)."""
    env = {**os.environ, "REDISCLI_AUTH": password} if password else None
    done = subprocess.run(host.wrap(["redis-cli", "-h", host.addr, "-p", str(port), *args]), env=env,
                          capture_output=True, text=True, timeout=10)
    return done.stdout


class HostSentinels:
    """A primary (port 6379), a replica (6380) and three sentinels (26379-26381, quorum 2) on one
    host, monitoring `MASTER`: `url` is Celery's `sentinel://` form, `fail_over()` SIGKILLs the
    primary, waits for the sentinels to promote the replica, and starts the dead one again as the
    new primary's replica, in sync before it returns (so the next failover loses nothing).
    `restart` is `fail_over`: to a campaign, the primary restarting is a failover."""

    MASTER = "toolqmaster"
    PORTS = (6379, 6380)
    SENTINEL_PORTS = (26379, 26380, 26381)

    def __init__(self, hosts: Hosts, role: str, args: list[str]) -> None:
        self.h, self.host = hosts, hosts.hosts[role]
        self.password = secrets.token_hex(16)
        self.args = [*args, "--masterauth", self.password, "--repl-diskless-sync-delay", "0"]
        self.nodes: dict[int, HostRedis] = {}
        for port in self.PORTS:
            replica = [] if port == self.PORTS[0] else ["--replicaof", self.host.addr, str(self.PORTS[0])]
            node = HostRedis(self.host, hosts.host_dir(f"{role}{port}"), [*self.args, *replica], port)
            node.password = self.password
            self.nodes[port] = node
        self.sentinels: list[HostProcess] = []
        self.failovers = 0

    @property
    def url(self) -> str:
        return ";".join(f"sentinel://:{self.password}@{self.host.addr}:{p}" for p in self.SENTINEL_PORTS) + "/0"

    def start(self) -> HostSentinels:
        for node in self.nodes.values():
            self.h._started(node)
        for port in self.SENTINEL_PORTS:
            d = self.h.host_dir(f"sentinel{port}")
            conf = d / "sentinel.conf"  # a sentinel rewrites its own config
            conf.write_text("\n".join([
                f"port {port}", f"bind {self.host.addr} 127.0.0.1", f'dir "{d}"', f'logfile "{d / "sentinel.log"}"',
                f"sentinel monitor {self.MASTER} {self.host.addr} {self.PORTS[0]} 2",
                f"sentinel auth-pass {self.MASTER} {self.password}",
                f"sentinel down-after-milliseconds {self.MASTER} 1000",
                f"sentinel failover-timeout {self.MASTER} 3000",
                f"sentinel parallel-syncs {self.MASTER} 1"]) + "\n")
            self.sentinels.append(self.h.process(self.host.role, ["redis-server", str(conf), "--sentinel"],
                                                 log=f"sentinel{port}.out"))
        wait_for(lambda: self._in_sync(self.PORTS[1]), 20, "the replica's first sync")
        wait_for(lambda: all(self._sees_replica(p) for p in self.SENTINEL_PORTS), 20, "the sentinels see the replica")
        return self

    def _ask(self, port: int, *args: str, password: str | None = None) -> str:
        return redis_cli(self.host, port, password, *args)

    def _in_sync(self, port: int) -> bool:
        return "master_link_status:up" in self._ask(port, "info", "replication", password=self.password)

    def _sees_replica(self, port: int) -> bool:
        return "OK" in self._ask(port, "SENTINEL", "CKQUORUM", self.MASTER) and \
            self._ask(port, "SENTINEL", "REPLICAS", self.MASTER).strip() != ""

    def primary(self) -> int | None:
        """The primary's port, as a sentinel says."""
        for port in self.SENTINEL_PORTS:
            said = self._ask(port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.MASTER).split()
            if len(said) == 2 and said[1].isdigit():
                return int(said[1])
        return None

    def cli(self, *args: str) -> str:
        """`redis-cli` on the current primary."""
        return self._ask(self.primary() or self.PORTS[0], *args, password=self.password)

    def fail_over(self, timeout: float = 60) -> None:
        old = self.primary() or self.PORTS[0]
        new = next(p for p in self.PORTS if p != old)
        self.nodes[old].kill()
        wait_for(lambda: self.primary() == new, timeout, "the sentinels promote the replica")
        node = self.nodes[old]
        node.args = [*self.args, "--replicaof", self.host.addr, str(new)]
        node.start()
        wait_for(lambda: self._in_sync(old), timeout, "the old primary's sync as a replica")
        self.failovers += 1

    restart = fail_over

    def stop(self) -> None:
        for child in (*self.sentinels, *self.nodes.values()):
            child.stop(grace=3)


class HostWorker(WorkerProcess):
    """A real `toolq worker` on a host: its command run through the host's namespaces."""

    def __init__(self, host: Host, redis_url: str, **kw: Any) -> None:
        super().__init__(redis_url, **kw)
        self.host = host
        self.with_parent = True

    def argv(self) -> list[str]:
        return self.host.wrap(super().argv())


class HostProcess(ChildProcess):
    """Any other command on a host (the fake model), its output in a log file."""

    stop_grace = 5.0

    def __init__(self, host: Host, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.host, self.argv, self.env, self.log = host, argv, env, log
        self.with_parent = True

    def start(self) -> HostProcess:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.host.wrap(self.argv), env={**os.environ, **self.env},
                                         cwd=import_path.NEUTRAL_CWD, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=self._preexec())
        return self


@dataclass
class Hosts:
    """The harness: `with Hosts(["redis", "orch", "w1", "w2"], workers={"w1", "w2"}) as h:`."""

    roles: list[str]
    workers: set[str] = field(default_factory=set)
    """Roles that get a private /tmp (the worker hosts)."""
    hosts: dict[str, Host] = field(default_factory=dict)
    dir: Path = field(default_factory=Path)

    def __post_init__(self) -> None:
        self.id = f"{os.getpid()}x{secrets.token_hex(3)}"
        self.subnet = f"10.213.{secrets.randbelow(254) + 1}"
        """Per harness: two harnesses on one machine use different addresses as well as switches."""
        self._children: list[ChildProcess] = []
        self._popened: list[subprocess.Popen[str]] = []
        self._closed = threading.Event()

    def netns(self, role: str) -> str:
        return f"{PREFIX}{self.id}-{role}"

    def names(self) -> list[str]:
        return [self.netns(SWITCH), *(self.netns(r) for r in self.roles)]

    def __enter__(self) -> Hosts:
        sweep_stale()
        atexit.register(self.close)
        try:
            self.dir = Path(tempfile.mkdtemp(prefix=f"toolq-hosts-{self.id}-", dir=BASE_DIR))
            self.workspace.mkdir()
            self._make_switch()
            for k, role in enumerate(self.roles):
                self.hosts[role] = self._make_host(role, f"{self.subnet}.{k + 2}")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make_switch(self) -> None:
        switch = self.netns(SWITCH)
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")

    def _make_host(self, role: str, addr: str) -> Host:
        # Both ends made inside the namespaces (the switch's, then moved to the host's): never in ours.
        name, switch, port = self.netns(role), self.netns(SWITCH), f"p-{role}"[:15]
        _ip("netns", "add", name)
        _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", name)
        _ip("-n", switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")
        private = (self.dir, [self.workspace, self.host_dir(role)]) if role in self.workers else None
        return Host(role, name, addr, private)

    @property
    def workspace(self) -> Path:
        """The folder every host sees (made with the harness, before any host mounts it)."""
        return self.dir / "workspace"

    def host_dir(self, role: str) -> Path:
        path = self.dir / role
        path.mkdir(exist_ok=True)
        return path

    def redis(self, role: str = "redis", args: list[str] | None = None) -> HostRedis:
        return self._started(HostRedis(self.hosts[role], self.host_dir(role), args))

    def worker(self, role: str, redis_url: str, *, start: bool = True, **kw: Any) -> HostWorker:
        """A started worker (ready) on host `role`, its log in the host's directory; with
        `start=False` made but not started (the caller starts it), still stopped at close."""
        kw.setdefault("name", f"{role}@{self.netns(role)}")
        worker = HostWorker(self.hosts[role], redis_url, logdir=self.host_dir(role), **kw)
        if not start:
            self._children.append(worker)
            return worker
        return self._started(worker)

    def sentinels(self, role: str = "redis", args: list[str] | None = None) -> HostSentinels:
        """A primary, a replica and three sentinels on host `role` (`HostSentinels`), started."""
        return HostSentinels(self, role, args or []).start()

    def host_of(self, pid: int) -> str | None:
        """The role of the host whose network process `pid` is on (None: gone, or on none of them)."""
        try:
            ino = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            return None
        for role in self.roles:
            try:
                if os.stat(NETNS_DIR / self.netns(role)).st_ino == ino:
                    return role
            except OSError:
                continue
        return None

    @contextmanager
    def inside(self, role: str) -> Iterator[None]:
        """The calling thread on host `role`'s network (and every thread and process it starts
        meanwhile: they inherit it), back on its own at the end: an orchestrator run in this
        process (the campaign's turns) then reaches Redis and the workers over the harness's links."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(NETNS_DIR / self.netns(role), os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(target)
            os.close(own)

    def process(self, role: str, argv: list[str], env: dict[str, str] | None = None, log: str = "process.log") \
            -> HostProcess:
        return self._started(HostProcess(self.hosts[role], argv, env or {}, self.host_dir(role) / log))

    def _started(self, child: Any) -> Any:
        self._children.append(child)
        child.start()
        return child

    def popen(self, role: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """A command on host `role` that the caller waits for (its pipes text); it dies with this
        process, even by SIGKILL, and is killed at close if it still runs."""
        proc = subprocess.Popen(self.hosts[role].wrap(argv), env={**os.environ, **(env or {})},
                                cwd=import_path.NEUTRAL_CWD, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, preexec_fn=die_with_parent())
        self._popened.append(proc)
        return proc

    def run(self, role: str, argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 120,
            stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """A command on host `role`, to its end (the orchestrator's `toolq run`)."""
        return subprocess.run(self.hosts[role].wrap(argv), env={**os.environ, **(env or {})}, input=stdin,
                              cwd=import_path.NEUTRAL_CWD,
                              capture_output=True, text=True, timeout=timeout)

    # Faults. Each is undone by heal().

    def drop(self, src: str, dst: str) -> None:
        """One-way loss: every packet from `src` to `dst` is dropped; `dst` to `src` still flows."""
        _ip("-n", self.netns(src), "neigh", "replace", self.hosts[dst].addr, "lladdr", NOWHERE_MAC,
            "dev", "eth0", "nud", "permanent")

    def cut(self, a: str, b: str) -> None:
        """A partition between two hosts, both ways; each still reaches every other host."""
        self.drop(a, b)
        self.drop(b, a)

    def isolate(self, role: str) -> None:
        """A host cut from every other (a frozen or unplugged machine, seen from the network)."""
        for other in self.roles:
            if other != role:
                self.cut(role, other)

    def netem(self, role: str, spec: list[str]) -> None:
        """`tc netem` on the host's link, e.g. ["delay", "50ms", "loss", "5%"] (see netem_available)."""
        subprocess.run(["ip", "netns", "exec", self.netns(role), "tc", "qdisc", "replace", "dev", "eth0", "root",
                        "netem", *spec], check=True, capture_output=True, timeout=10)

    def throttle(self, role: str, rate: str) -> None:
        """A slow link: the host sends at most `rate` (e.g. "256kbit"), the rest queued (tbf, which
        kernels without netem have): every packet it sends waits its turn, as on a congested link."""
        subprocess.run(["ip", "netns", "exec", self.netns(role), "tc", "qdisc", "replace", "dev", "eth0", "root",
                        "tbf", "rate", rate, "burst", "16kb", "latency", "10s"], check=True, capture_output=True,
                       timeout=10)

    def heal(self) -> None:
        """Every host reaches every other again, without delay or loss."""
        for role in self.roles:
            _ip("-n", self.netns(role), "neigh", "flush", "nud", "permanent", "dev", "eth0", check=False)
            subprocess.run(["ip", "netns", "exec", self.netns(role), "tc", "qdisc", "del", "dev", "eth0", "root"],
                           capture_output=True, timeout=10)

    def close(self) -> None:
        """Stop every process, then delete every namespace (and with them the links); idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        for proc in self._popened:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        for child in self._children:
            child.terminate()
        for child in reversed(self._children):
            try:
                child.stop(grace=3)
            except Exception:  # one that will not stop must not keep the namespaces alive
                child.kill()
        for name in reversed(self.names()):
            _delete_namespace(name)
        atexit.unregister(self.close)

    def remove_dir(self) -> None:
        """The harness's directory (logs, the workspace): kept by a failed test for its logs."""
        shutil.rmtree(self.dir, ignore_errors=True)


# The fake model on a host: its requests recorded to a file when it stops.

def _serve_recording(script: str, port: int, record: Path) -> int:
    from toolq.dev.fake_model.server import FakeModel

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with FakeModel(script, port=port, log=sys.stderr) as fake:
        print(fake.base_url, flush=True)
        while not stop.wait(0.2):
            pass
        record.write_text(json.dumps(fake.requests))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolq.dev.hosts")
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fake-model", help="serve a script; write the request bodies to --record on SIGTERM")
    f.add_argument("--script", required=True)
    f.add_argument("--port", type=int, required=True)
    f.add_argument("--record", type=Path, required=True)
    args = parser.parse_args(argv)
    return _serve_recording(args.script, args.port, args.record)


if __name__ == "__main__":
    sys.exit(main())
