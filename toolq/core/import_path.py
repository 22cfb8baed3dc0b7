"""Where toolq's processes import code from: never a workspace, never the current directory.

A command writes its workspace, and the workspace is often the current directory of the
process that started the turn. A module there named after one of toolq's lazily imported
dependencies (`sniffio.py`, `h11.py`) would run unsandboxed, with the fleet's secrets, the next
time that import happens. So every toolq process drops the current directory, empty and
relative entries from `sys.path` at its start (`isolate`), the Python processes toolq starts run
with `-P` from a fixed folder (`python_argv`), tool modules come from an explicit path
(`TOOLQ_TOOLS_PATH`, or PYTHONPATH, or installed packages), and a workspace that is on that path,
or holds part of it (a virtualenv inside the project), is refused (`workspace_on_import_path`).
"""

from __future__ import annotations

import importlib.machinery
import itertools
import os
import sys

#: Folders, separated by os.pathsep, where `--tools` modules are found besides installed packages.
TOOLS_PATH_ENV = "TOOLQ_TOOLS_PATH"
#: Where the Python processes toolq starts run: a folder no command can write.
NEUTRAL_CWD = "/"


def _explicit(value: str) -> list[str]:
    return [os.path.abspath(p) for p in value.split(os.pathsep) if p]


def isolate() -> None:
    """Drop from `sys.path` what only the current directory put there (the folder itself, which
    `python -m` and an empty PYTHONPATH entry add, unless PYTHONPATH names it; relative entries),
    then add the tools path. Only for a process toolq's command line started: a host program's
    path is its own. The tools path is written back to the environment made absolute, so the
    processes this one starts (embedded workers) find the same folders wherever they run."""
    cwd = os.getcwd()
    given = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    named = {p for p in given if os.path.isabs(p)}
    # Python makes PYTHONPATH's empty and relative entries absolute against the current directory.
    derived = {cwd, *(os.path.abspath(p) for p in given if p and not os.path.isabs(p))} - named
    kept = [entry for entry in sys.path if not _relative(entry) and entry not in derived]
    tools = _explicit(os.environ.get(TOOLS_PATH_ENV, ""))
    if tools:
        os.environ[TOOLS_PATH_ENV] = os.pathsep.join(tools)
    sys.path[:] = list(dict.fromkeys([*kept, *tools]))


def started_as_module() -> bool:
    """Whether this is `python -m toolq...` still finding its module: Python put the current
    directory first on sys.path, and toolq's package is being imported from the folder it found."""
    argv = sys.orig_argv
    named = any(flag == "-m" and (module == "toolq" or module.startswith("toolq."))
                for flag, module in itertools.pairwise(argv))
    return sys.argv[:1] == ["-m"] and named


def _relative(entry: str) -> bool:
    """An entry read against the current directory: '' or a relative folder. A path hook's own
    entry (an editable install's finder) is not a folder, and stays."""
    if os.path.isabs(entry):
        return False
    finder = sys.path_importer_cache.get(entry)
    return finder is None or isinstance(finder, importlib.machinery.FileFinder)


def python_argv(*args: str) -> list[str]:
    """This interpreter, isolated from its current directory (`-P`: no script or `-m` folder on
    sys.path), with `args`. Start it with `cwd=NEUTRAL_CWD`."""
    return [sys.executable, "-P", *args]


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def workspace_on_import_path(workspace: str) -> str | None:
    """The entry of this process's import path that `workspace` is, holds or lies in, if any."""
    roots = {os.path.realpath(workspace), os.path.abspath(workspace)}
    for entry in sys.path:
        if not entry or not os.path.isabs(entry):
            continue
        for where in {os.path.realpath(entry), os.path.abspath(entry)}:
            if any(_inside(where, root) or _inside(root, where) for root in roots):
                return entry
    return None
