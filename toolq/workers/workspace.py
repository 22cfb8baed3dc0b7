"""Where file tools may touch the machine: confinement of model-named paths to the workspace.

Every path a model names goes through `resolve_in_workspace`, which resolves it fully (symlinks
included) and refuses anything that ends up outside the workspace. Nothing is followed before the
check.
"""

from __future__ import annotations

import os
from pathlib import Path

from toolq.orchestrator.errors import RespondToModel


def resolve_in_workspace(workspace: Path, path: str) -> Path:
    """The fully resolved path that `path` names, which must lie inside `workspace`.

    Relative paths resolve against the workspace; absolute paths must already point inside it.
    `..` components are refused outright, and so is a path whose symlinks lead out.
    """
    root = Path(workspace).resolve()
    if "\0" in path:
        raise RespondToModel(f"path `{path}` contains a NUL byte")
    given = Path(path)
    if ".." in given.parts:
        raise RespondToModel(f"path `{path}` is not allowed: `..` components may not be used")
    if given.is_absolute():
        # Accept the workspace as configured or as resolved (it may itself sit under a symlink).
        lexical = Path(os.path.normpath(given))
        if not (_is_within(lexical, root) or _is_within(lexical, Path(os.path.abspath(workspace)))):
            raise RespondToModel(f"path `{path}` is outside the workspace `{root}`")
        candidate = lexical
    else:
        candidate = root / given
    resolved = candidate.resolve()
    if not _is_within(resolved, root):
        raise RespondToModel(f"path `{path}` leads outside the workspace `{root}` through a symlink")
    return resolved


def _is_within(path: Path, root: Path) -> bool:
    return path == root or path.is_relative_to(root)
