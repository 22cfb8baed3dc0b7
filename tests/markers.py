"""Markers for the processes a test starts and then looks for machine-wide (pgrep, /proc): unique to
this pytest process, also beside another one running at the same time (`./dev test` runs test files
side by side). Fixed width, so that no process's marker is a prefix of another's."""

import os

#: This pytest process's own digits; a test appends its own after them.
PROCESS = f"{os.getpid():07d}"

#: The files that start workers as the users of `tests/integration/unprivileged.py` (nobody, 4244):
#: `./dev test` runs them in one process, one after another, never beside each other. A call's
#: RLIMIT_NPROC counts every process of its uid (it may fork what the uid runs now plus its limit),
#: and their red teams attack their uid's processes.
UNPRIVILEGED_FILES = frozenset({
    "tests/integration/test_env_namespace.py",
    "tests/integration/test_front_door_tools.py",
    "tests/integration/test_hostile_env_namespace.py",
    "tests/integration/test_hostile_envs.py",
    "tests/integration/test_hostile_exec.py",
    "tests/integration/test_hostile_file_bounds.py",
    "tests/integration/test_hostile_front_doors.py",
    "tests/integration/test_hostile_git.py",
    "tests/integration/test_hostile_imports.py",
    "tests/integration/test_hostile_landlock.py",
    "tests/integration/test_hostile_mcp_secrets.py",
    "tests/integration/test_hostile_privilege.py",
    "tests/integration/test_hostile_root_files.py",
    "tests/integration/test_hostile_telemetry.py",
    "tests/integration/test_tty_interrupt.py",
    "tests/integration/test_unprivileged_worker.py",
})
