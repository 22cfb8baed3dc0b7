"""`toolq flower`: Flower on toolq's broker, on loopback and behind basic auth by default.

Flower's API can revoke and terminate any call, and its `/metrics` and `/healthcheck` answer
without auth in every mode (docs/reference/celery-notes.md#flower). So it binds to 127.0.0.1 unless told otherwise,
and its API is served without auth only when asked, and then only on loopback. Flower runs as
`python -m celery --app toolq.workers.app flower`.

Workers send task events only once a monitor asks (workers/config.py): Flower broadcasts
`enable_events` every 5 s, the first 5 s after it starts, so `toolq flower` asks once itself as it
starts, and Flower sees the calls of the workers already running from its first second.
"""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import httpx

from toolq.core import import_path
from toolq.core.errors import ConfigurationError
from toolq.core.settings import Settings, mask_url_password
from toolq.local.embedded import ChildProcess, free_port, wait_for
from toolq.workers import redis_clients

#: Flower reads every `FLOWER_<option>` variable itself; these two we set (or clear) on purpose.
BASIC_AUTH_ENV = "FLOWER_BASIC_AUTH"
UNAUTHENTICATED_ENV = "FLOWER_UNAUTHENTICATED_API"


@dataclass
class FlowerLaunch:
    """What to run: the command, its environment, and what the user should be warned about."""

    argv: list[str]
    env: dict[str, str] = field(repr=False)
    """Holds the credentials (kept out of argv, which every local user can read in `ps`)."""
    address: str
    port: int
    warnings: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{self.port}"


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def flower_launch(settings: Settings, *, port: int | None = None, address: str | None = None,
                  unauthenticated_api: bool = False, base_env: dict[str, str] | None = None) -> FlowerLaunch:
    """Build Flower's command line; raises ConfigurationError when it must not start."""
    if not settings.redis_url:
        raise ConfigurationError("flower needs REDIS_URL (or CELERY_BROKER_URL): the broker the workers use")
    address = address if address is not None else settings.flower_address
    port = port if port is not None else settings.flower_port
    user, password = settings.flower_user, settings.flower_password
    warnings: list[str] = []

    env = dict(os.environ if base_env is None else base_env)
    # Celery prefers CELERY_BROKER_URL/CELERY_RESULT_BACKEND over the app's own config; pass
    # toolq's settings instead, so Flower watches exactly the broker the settings name.
    env.pop("CELERY_BROKER_URL", None)
    env.pop("CELERY_RESULT_BACKEND", None)
    env["REDIS_URL"] = settings.redis_url
    if settings.result_url:
        env["TOOLQ_RESULT_URL"] = settings.result_url
    if settings.sentinel_master:  # a sentinel:// URL's, when the settings did not come from this environment
        env["TOOLQ_SENTINEL_MASTER"] = settings.sentinel_master
    if settings.sentinel_password:
        env["TOOLQ_SENTINEL_PASSWORD"] = settings.sentinel_password
    if settings.tools:
        env["TOOLQ_TOOLS"] = ",".join(settings.tools)
    # Only the credentials below and the flag the user gave count, never ones left in the shell.
    env.pop(BASIC_AUTH_ENV, None)
    env.pop(UNAUTHENTICATED_ENV, None)

    if bool(user) != bool(password):
        raise ConfigurationError("set both FLOWER_USER and FLOWER_PASSWORD (only one is set)")
    if user and password:
        # HTTP basic auth splits "user:password" at the first colon; Flower splits its list at commas.
        if ":" in user or "," in user or "," in password:
            raise ConfigurationError("FLOWER_USER may not contain ':' or ',', "
                                     "and FLOWER_PASSWORD may not contain ','")
        env[BASIC_AUTH_ENV] = f"{user}:{password}"
        if unauthenticated_api:
            warnings.append("--unauthenticated-api ignored: FLOWER_USER and FLOWER_PASSWORD are set, "
                            "so the API requires them")
    elif unauthenticated_api:
        if not is_loopback(address):
            raise ConfigurationError(f"--unauthenticated-api is only allowed on a loopback address, "
                                     f"not {address!r}: anyone who reaches it could revoke calls")
        env[UNAUTHENTICATED_ENV] = "true"
        warnings.append(f"Flower's API has no authentication: any local user can list and revoke calls "
                        f"on {address}:{port}")
    else:
        raise ConfigurationError("refusing to start Flower without authentication; set "
                                 "FLOWER_USER and FLOWER_PASSWORD, or pass --unauthenticated-api (loopback only)")
    if not is_loopback(address):
        warnings.append(f"Flower listens on {address or 'every interface'}: /metrics and /healthcheck answer "
                        "without auth, and basic auth travels in clear text over plain HTTP; put it behind TLS or "
                        "a firewall")

    argv = [*import_path.python_argv("-m", "celery"), "--app", "toolq.workers.app", "flower",
            f"--address={address}", f"--port={port}"]
    return FlowerLaunch(argv, env, address, port, warnings)


def run_flower(settings: Settings, *, port: int | None = None, address: str | None = None,
               unauthenticated_api: bool = False, err: TextIO = sys.stderr) -> int:
    """`toolq flower`: become Flower (exec), so Ctrl-C and a service manager's SIGTERM reach it directly."""
    launch = flower_launch(settings, port=port, address=address, unauthenticated_api=unauthenticated_api)
    for w in launch.warnings:
        print(f"toolq flower: warning: {w}", file=err)
    assert settings.redis_url is not None
    print(f"toolq flower: {launch.url} watching {mask_url_password(settings.redis_url)}", file=err)
    try:  # a broker that is away is not waited for here: Flower says so itself, and asks every 5 s
        redis_clients.sync_client(settings.redis_target() or settings.redis_url, socket_connect_timeout=1.0,
                                  socket_timeout=1.0).ping()
        enable_task_events(settings)
    except Exception as e:
        print(f"toolq flower: warning: could not ask the workers for task events yet: {e}", file=err)
    err.flush()
    sys.stdout.flush()
    os.chdir(import_path.NEUTRAL_CWD)  # Celery imports the app with the current directory on sys.path
    os.execve(launch.argv[0], launch.argv, launch.env)
    return 1  # not reached: execve only returns by raising


def enable_task_events(settings: Settings, workers: list[str] | None = None, timeout: float = 5.0) -> None:
    """Ask the workers to send task events from now on (what Flower's periodic broadcast does).
    With `workers` named, return once each has confirmed; else broadcast without waiting."""
    from toolq.workers.config import make_app

    app = make_app(settings)
    try:
        if workers:
            replies = app.control.enable_events(destination=workers, reply=True, timeout=timeout,
                                                limit=len(workers)) or []
            missing = set(workers) - {name for r in replies for name in r}
            if missing:
                raise TimeoutError(f"no answer to enable_events from {sorted(missing)} within {timeout:g}s")
        else:
            app.control.enable_events()
    finally:
        app.close()


class FlowerProcess(ChildProcess):
    """Flower as a child process on a free loopback port (tests); ready once /healthcheck answers."""

    stop_grace = 5.0

    def __init__(self, settings: Settings, *, port: int | None = None, address: str = "127.0.0.1",
                 unauthenticated_api: bool = False, logdir: Path | None = None) -> None:
        self.settings = settings
        self.launch = flower_launch(settings, port=port or free_port(), address=address,
                                    unauthenticated_api=unauthenticated_api)
        self.logdir = logdir or Path(tempfile.mkdtemp(prefix="toolq-flower-"))
        self.log = self.logdir / f"flower-{self.launch.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return self.launch.url

    def start(self, timeout: float = 30) -> FlowerProcess:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(self.launch.argv, env=self.launch.env, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=import_path.NEUTRAL_CWD, start_new_session=True)
        wait_for(self._healthy, timeout, f"flower on {self.url}", self.log)
        return self

    def wait_for_workers(self, names: Iterable[str] = (), timeout: float = 30) -> None:
        """Until Flower has heard from the named workers (any worker, if none are named).

        /healthcheck answers before Flower has subscribed to worker events, and events sent before
        that never reach it. Workers send a heartbeat every 2 s, which marks them online in /metrics.
        """
        wanted = set(names)

        def heard() -> bool:
            self._healthy()  # raises if Flower died
            text = httpx.get(f"{self.url}/metrics", timeout=2).text
            online = set(re.findall(r'^flower_worker_online\{worker="([^"]+)"\} 1\.0$', text, re.MULTILINE))
            return wanted <= online if wanted else bool(online)

        wait_for(heard, timeout, f"flower on {self.url} to hear from {sorted(wanted) or 'a worker'}", self.log)
        # Flower's own `enable_events` comes up to 5 s after its start: ask now, as `toolq flower` does.
        enable_task_events(self.settings, sorted(wanted) or None)

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"flower exited with {self.proc.returncode}:\n"
                               + self.log.read_text(errors="replace")[-2000:])
        try:
            return httpx.get(f"{self.url}/healthcheck", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

