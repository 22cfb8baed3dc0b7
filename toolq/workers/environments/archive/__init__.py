"""Trees <-> tars, safely (issue 28 items 1, 4 and 8).

An environment's files travel as tars: an uploaded folder (`pack_dir`), a git commit's
`git archive`, a checkpoint's changes against its base (`tree_delta`). Every tar that reaches a
host or comes back from one is hostile input: the commands that wrote a checkpoint's files are the
model's. So a tar is only ever *parsed* with `tarfile` (never `extractall`), every member is
checked before anything is written (`_members`), and writes go through directory fds opened with
O_NOFOLLOW, one component at a time, with O_CREAT|O_EXCL: nothing in the destination is followed,
even if something else changes it meanwhile.

One module a job; each imports only those listed before it:

    model     the caps, entries and manifests, `ArchiveError`, `ApplyReport`, the name and symlink checks
    walk      reading a tree by fd (`_walk`, `_read_file`) and counting it against the caps (`_Budget`)
    tarfiles  the deterministic tar writer, and the reader that checks an untrusted tar's members
    pack      an uploaded folder -> a tar and its manifest (`pack_dir`; a git checkout's listing)
    unpack    a tar -> files through confined fd opens (`extract`)
    delta     an environment -> its changes against its base (`tree_delta`, `Delta`)
    diff      a delta -> the unified diff a turn's outcome carries (`unified_diff`, `BaseTree`)
    apply     a checkpoint -> applied to the user's folder (`apply_delta`)

Code outside the package imports from here, never from the modules.
"""

from toolq.workers.environments.archive.apply import apply_delta
from toolq.workers.environments.archive.delta import Delta, tree_delta
from toolq.workers.environments.archive.diff import BaseTree, unified_diff
from toolq.workers.environments.archive.model import (
    ApplyReport,
    ArchiveError,
    Entry,
    Limits,
    Manifest,
    Packed,
    manifest_from_json,
    manifest_to_json,
)
from toolq.workers.environments.archive.pack import pack_dir
from toolq.workers.environments.archive.tarfiles import manifest_of
from toolq.workers.environments.archive.unpack import extract

__all__ = ["ApplyReport", "ArchiveError", "BaseTree", "Delta", "Entry", "Limits", "Manifest", "Packed", "apply_delta",
           "extract", "manifest_from_json", "manifest_of", "manifest_to_json", "pack_dir", "tree_delta", "unified_diff"]
