"""toolq.workers.workspace: model-named paths confined to the workspace."""

from __future__ import annotations

import pytest

from toolq.orchestrator.errors import RespondToModel
from toolq.workers.workspace import resolve_in_workspace


def test_relative_path_resolves_inside_the_workspace(tmp_path):
    assert resolve_in_workspace(tmp_path, "src/a.py") == tmp_path.resolve() / "src" / "a.py"


def test_absolute_path_inside_the_workspace_is_allowed(tmp_path):
    target = tmp_path / "a.txt"
    assert resolve_in_workspace(tmp_path, str(target)) == target.resolve()


def test_workspace_root_itself_is_allowed(tmp_path):
    assert resolve_in_workspace(tmp_path, ".") == tmp_path.resolve()
    assert resolve_in_workspace(tmp_path, str(tmp_path)) == tmp_path.resolve()


@pytest.mark.parametrize("path", ["../outside.txt", "src/../../etc/passwd", "a/../b"])
def test_dotdot_components_are_refused_and_named(tmp_path, path):
    with pytest.raises(RespondToModel) as e:
        resolve_in_workspace(tmp_path, path)
    assert f"`{path}`" in e.value.message and "`..`" in e.value.message


def test_absolute_path_outside_the_workspace_is_refused(tmp_path):
    with pytest.raises(RespondToModel) as e:
        resolve_in_workspace(tmp_path, "/etc/passwd")
    assert e.value.message == f"path `/etc/passwd` is outside the workspace `{tmp_path.resolve()}`"


def test_sibling_directory_with_shared_prefix_is_outside(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (tmp_path / "ws2").mkdir()
    with pytest.raises(RespondToModel):
        resolve_in_workspace(ws, str(tmp_path / "ws2" / "x"))


def test_symlink_leading_out_is_refused(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    (ws / "link.txt").symlink_to(secret)
    (ws / "dirlink").symlink_to(tmp_path)
    for path in ["link.txt", "dirlink/secret.txt", str(ws / "link.txt")]:
        with pytest.raises(RespondToModel) as e:
            resolve_in_workspace(ws, path)
        assert f"`{path}`" in e.value.message and "symlink" in e.value.message


def test_symlink_staying_inside_is_followed(tmp_path):
    (tmp_path / "real.txt").write_text("x")
    (tmp_path / "alias.txt").symlink_to(tmp_path / "real.txt")
    assert resolve_in_workspace(tmp_path, "alias.txt") == (tmp_path / "real.txt").resolve()


def test_nul_byte_in_path_is_refused(tmp_path):
    with pytest.raises(RespondToModel, match="NUL"):
        resolve_in_workspace(tmp_path, "a\0b")
