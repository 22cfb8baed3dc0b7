"""What every test shares: the workers and commands the tests start find the tests' own tool
modules (`tests.integration.testtools`, ...) on the explicit tools path, as a user's would be;
toolq never imports from the current directory."""

from __future__ import annotations

import os

from tests.paths import ROOT
from toolq.core.import_path import TOOLS_PATH_ENV

_given = [p for p in os.environ.get(TOOLS_PATH_ENV, "").split(os.pathsep) if p]
os.environ[TOOLS_PATH_ENV] = os.pathsep.join(dict.fromkeys([str(ROOT), *_given]))

from typing import Any  # noqa: E402

import pytest  # noqa: E402  (after the tools path is set, as every import of toolq must be)

from tests import markers  # noqa: E402


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`./dev test` runs files side by side (pytest-xdist): each file in one process, in order, so
    its module fixtures start once; the files of `markers.UNPRIVILEGED_FILES` in one process
    together. (A scheduler of our own: xdist's `loadgroup` marks no longer reach its scheduler
    under pytest 9, which no longer reads the node id xdist rewrites.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "unprivileged" if path in markers.UNPRIVILEGED_FILES else path

    return ByFile(config, log)
