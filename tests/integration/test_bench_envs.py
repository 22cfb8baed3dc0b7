"""`toolq bench envs --quick --json` runs end to end (its own Redis and workers; overlay, then
copy): every figure is there and no run failed. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from toolq.core import import_path

pytestmark = pytest.mark.integration

FIGURES = {"create": ("p50", "p99", "goal_met"), "cold": ("upload", "create", "exec", "total"),
           "checkpoint": ("p50", "p99", "goal_met"), "fork": ("n", "total", "goal_met"),
           "conversations": ("env_calls_per_s", "shared_calls_per_s", "ratio", "goal_met"),
           "alive": ("n", "create", "ready", "on_disk", "call_ok", "destroy", "left_on_disk", "goal_met")}


def test_bench_envs_quick_gives_every_figure_in_each_mode():
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "CELERY_BROKER_URL")}
    done = subprocess.run([*import_path.python_argv("-m", "toolq.cli.main"), "bench", "envs", "--quick", "--json"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=import_path.NEUTRAL_CWD)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(done.stdout)
    assert res["failed"] == [], res["runs"]
    assert sorted(res["runs"]) == ["copy", "overlay"]
    for mode in ("overlay", "copy"):
        got = res["runs"][mode]
        # Not root, a host mounts its overlays in a namespace of its own where the kernel allows one.
        assert got["mode"] == mode or (os.geteuid() != 0 and got["mode"] == "copy"), got.get("note")
        for figure, fields in FIGURES.items():
            assert set(fields) <= set(got[figure]), (mode, figure, got[figure])
        alive = got["alive"]
        assert alive["ready"] == alive["on_disk"] == alive["n"] and alive["call_ok"] and alive["left_on_disk"] == 0
    if os.geteuid() == 0:
        assert set(res["floor_mount"]) == {"mkdirs", "mount", "umount"}
