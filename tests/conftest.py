"""What every test shares: the workers and commands the tests start find the tests' own tool
modules (`tests.integration.testtools`, ...) on the explicit tools path, as a user's would be;
toolq never imports from the current directory."""

from __future__ import annotations

import os

from tests.paths import ROOT
from toolq.core.import_path import TOOLS_PATH_ENV

_given = [p for p in os.environ.get(TOOLS_PATH_ENV, "").split(os.pathsep) if p]
os.environ[TOOLS_PATH_ENV] = os.pathsep.join(dict.fromkeys([str(ROOT), *_given]))
