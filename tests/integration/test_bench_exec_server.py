"""`toolq bench exec-server --quick --json` runs end to end (a Redis and workers of its own, the real
Codex CLI through `toolq exec-server` and through `codex exec-server`): both step times and their
ratio are reported. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.integration.codex_cli import codex_or_skip
from toolq.core import import_path

pytestmark = pytest.mark.integration


def test_bench_exec_server_quick_reports_both_step_times_and_their_ratio():
    codex_or_skip()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "CELERY_BROKER_URL")}
    done = subprocess.run([*import_path.python_argv("-m", "toolq.cli.main"), "bench", "exec-server", "--quick",
                           "--json"], capture_output=True, text=True, timeout=600, env=env,
                          cwd=import_path.NEUTRAL_CWD)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    res = json.loads(done.stdout)
    assert res["failed"] == [], res
    rounds = res["sizes"]["rounds"]
    for side in ("toolq", "codex"):
        assert res[side]["p50"] > 0 and len(res[side]["samples"]) == rounds, res
    assert res["ratio"] > 0 and isinstance(res["goal_met"], bool)
