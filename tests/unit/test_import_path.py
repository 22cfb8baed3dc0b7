"""`import_path`: what a toolq process drops from sys.path, and which workspaces it refuses."""

from __future__ import annotations

import os
import sys

import pytest

from toolq.core import import_path


@pytest.fixture
def path(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv(import_path.TOOLS_PATH_ENV, raising=False)
    return tmp_path


def test_the_current_directory_and_relative_entries_are_dropped(path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"/nowhere{os.pathsep}{os.pathsep}rel")
    sys.path[:0] = [str(path), "", "rel", str(path / "rel")]
    import_path.isolate()
    assert str(path) not in sys.path and "" not in sys.path and "rel" not in sys.path
    assert str(path / "rel") not in sys.path  # what Python made of PYTHONPATH's relative entry


def test_a_folder_pythonpath_names_stays(path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(path))
    sys.path.insert(0, str(path))
    import_path.isolate()
    assert str(path) in sys.path


def test_the_tools_path_is_added_made_absolute(path, monkeypatch):
    (path / "tools").mkdir()
    monkeypatch.setenv(import_path.TOOLS_PATH_ENV, "tools")
    import_path.isolate()
    assert sys.path[-1] == str(path / "tools") and os.environ[import_path.TOOLS_PATH_ENV] == str(path / "tools")


def test_a_workspace_on_holding_or_inside_the_import_path_is_named(path, monkeypatch):
    monkeypatch.setattr(sys, "path", [str(path / "proj" / ".venv" / "site-packages"), str(path / "tools")])
    assert import_path.workspace_on_import_path(str(path / "proj"))  # holds a virtualenv
    assert import_path.workspace_on_import_path(str(path / "tools"))
    assert import_path.workspace_on_import_path(str(path / "tools" / "sub"))
    assert import_path.workspace_on_import_path(str(path / "elsewhere")) is None
    assert import_path.workspace_on_import_path(str(path / "tool")) is None  # a prefix is not a parent


def test_processes_toolq_starts_do_not_put_their_folder_on_sys_path():
    assert import_path.python_argv("-m", "x")[:2] == [sys.executable, "-P"]


def test_python_m_toolq_drops_the_folder_it_was_started_in_before_toolq_imports_anything(tmp_path):
    """`python -m toolq...` from a folder holding a planted `typing.py` (imported by toolq's
    package before any of its commands runs): the package isolates itself first."""
    import subprocess

    (tmp_path / "typing.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n")
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    out = subprocess.run([sys.executable, "-m", "toolq.cli.main", "config"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "imported").exists()
