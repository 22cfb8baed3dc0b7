"""^C to a tty session interrupts its command, on every backend, as root and as an unprivileged
worker: the command is a session leader whose controlling terminal is its own pty, in the
foreground group, so the line discipline sends SIGINT for byte 0x03 (`cell_init._init`,
`isolation.take_ctty`). And that terminal reaches nothing but the command: TIOCSTI on it types
into the command's own input, and another session's pty is out of its reach.
"""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from tests.integration.test_front_door_tools import Door, output, session_of
from tests.integration.test_hostile_exec import hostile_workers, locked_redis  # noqa: F401 - fixtures
from tests.integration.test_sessions import parts

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["bwrap-root", "bwrap-nobody", "bwrap-root-nocells", "landlock-root",
                                        "none-root"])
def tty_worker(request, locked_redis, tmp_path_factory):  # noqa: F811 - the fixture above
    """nocells: bubblewrap per command (TOOLQ_SANDBOX_CELLS=0), not a slot's cell."""
    backend, user, *cells = request.param.split("-")
    for worker in hostile_workers(backend, locked_redis, tmp_path_factory, user=user == "nobody",
                                  **({"TOOLQ_SANDBOX_CELLS": "0"} if cells else {})):
        worker.cells = not cells
        yield worker


def handles_it(worker) -> bool:
    """Whether the command itself handles its SIGINT. Without cells bubblewrap is in the terminal's
    group too, and its monitor dies of the ^C, taking the sandbox down: the command ends with 130,
    maybe before it could say a word."""
    return worker.cells or worker.backend != "bwrap"


SLEEPY_PYTHON = "python3 -c 'import time; print(\"ready\", flush=True); time.sleep(100)'"
#: Types "hello" into its own terminal with TIOCSTI, then reads a line: what it got is what it typed.
SELF_INJECT = ("python3 -c 'import fcntl, sys, termios\n"
               "try:\n"
               "    [fcntl.ioctl(0, termios.TIOCSTI, bytes([c])) for c in b\"hello\\n\"]\n"
               "except OSError as e:\n"
               "    print(\"refused\", e.errno, flush=True); sys.exit(0)\n"
               "print(\"got\", sys.stdin.readline().strip(), flush=True)'")
#: Tries to type into every other terminal it can open.
OTHERS_INJECT = ("python3 -c 'import fcntl, glob, os, termios\n"
                 "own = os.fstat(0)\n"
                 "for p in glob.glob(\"/dev/pts/[0-9]*\"):\n"
                 "    try:\n"
                 "        fd = os.open(p, os.O_RDWR | os.O_NOCTTY)\n"
                 "    except OSError as e:\n"
                 "        print(\"cannot open\", p, e.errno, flush=True); continue\n"
                 "    st = os.fstat(fd)\n"
                 "    if (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino): continue\n"
                 "    try:\n"
                 "        [fcntl.ioctl(fd, termios.TIOCSTI, bytes([c])) for c in b\"pwned\\n\"]\n"
                 "        print(\"typed into\", p, flush=True)\n"
                 "    except OSError as e:\n"
                 "        print(\"refused\", p, e.errno, flush=True)\n"
                 "print(\"tried\", flush=True)'")


async def exec_tty(door: Door, cmd: str, yield_ms: int = 2000) -> tuple[int | None, int | None, str]:
    return parts(await door.call("exec_command", {"cmd": cmd, "tty": True, "yield_time_ms": yield_ms}))


async def write(door: Door, session: int, chars: str, yield_ms: int = 10_000) -> tuple[int | None, int | None, str]:
    return parts(await door.call("write_stdin", {"session_id": session, "chars": chars, "yield_time_ms": yield_ms}))


def test_ctrl_c_interrupts_a_tty_exec_command_session(tty_worker, tmp_path):
    async def scenario() -> None:
        async with Door(tty_worker, tty_worker.workspace(tmp_path)) as door:
            session, code, text = await exec_tty(door, "sleep 1000", yield_ms=500)
            assert session is not None and code is None, text
            _, code, text = await write(door, session, "\u0003")
            assert code == 130, text

            session, code, text = await exec_tty(door, SLEEPY_PYTHON)
            assert session is not None and "ready" in text, text
            _, code, text = await write(door, session, "\u0003")
            assert code == 130 and ("KeyboardInterrupt" in text or not handles_it(tty_worker)), text

    asyncio.run(scenario())


def test_ctrl_c_interrupts_a_front_door_tty_process(tty_worker, tmp_path):
    async def scenario() -> None:
        async with Door(tty_worker, tty_worker.workspace(tmp_path)) as door:
            started = asyncio.create_task(door.start("py", ["bash", "-c", SLEEPY_PYTHON], tty=True))
            session = session_of(await door.until("py", lambda ev: b"ready" in output(ev)))
            data = base64.b64encode(b"\x03").decode()
            assert json.loads(await door.call("process_write", {"session_id": session, "data": data})) == {
                "status": "accepted"}
            assert (await started)["exit_code"] == 130
            assert b"KeyboardInterrupt" in output(door.events("py")) or not handles_it(tty_worker)

    asyncio.run(scenario())


def test_a_tty_commands_terminal_reaches_only_the_command(tty_worker, tmp_path):
    async def scenario() -> None:
        async with Door(tty_worker, tty_worker.workspace(tmp_path)) as door:
            # No descriptor more than a spawn without a tty has (its stdio, the one ls reads the folder with).
            _, code, text = await exec_tty(door, "ls /proc/self/fd", yield_ms=10_000)
            plain = parts(await door.call("exec_command", {"cmd": "ls /proc/self/fd", "yield_time_ms": 10_000}))[2]
            assert code == 0 and {"0", "1", "2"} <= set(text.split()) and len(text.split()) == len(plain.split()), (
                text, plain)
            _, code, text = await exec_tty(door, SELF_INJECT, yield_ms=10_000)
            assert code == 0 and ("got hello" in text or "refused" in text), text  # refused: legacy_tiocsti off

            if tty_worker.backend == "none":
                return  # unconfined by choice (TOOLQ_SANDBOX=none): as root it may type into any terminal
            victim, code, text = await exec_tty(door, "cat", yield_ms=300)
            assert victim is not None, text
            _, code, text = await exec_tty(door, OTHERS_INJECT, yield_ms=10_000)
            assert code == 0 and "tried" in text and "typed into" not in text, text
            _, _, seen = await write(door, victim, "", yield_ms=500)
            assert "pwned" not in seen, seen
            _, code, _ = await write(door, victim, "\u0004")
            assert code == 0

    asyncio.run(scenario())
