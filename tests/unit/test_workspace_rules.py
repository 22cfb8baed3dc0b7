"""Which folders may be a turn's workspace, checked where the turn starts and again on the worker
where each call runs (toolq/core/settings.py `workspace_problem`, toolq/workers/execute.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from toolq.core.calls import FunctionPayload, ToolInvocation, ToolName
from toolq.core.catalog import Catalog, ToolContext, tool
from toolq.core.settings import workspace_problem
from toolq.core.states import CallState
from toolq.workers.execute import refusal


@pytest.mark.parametrize("where", ["/", "/etc", "/etc/cron.d", "/tmp", "/var", "/var/log/app", "/var/spool/cron",
                                   "/var/lib", "/root", "/home", "/home/alice", "/usr/local/src", "/proc/self"])
def test_system_shared_and_home_folders_are_refused(where):
    assert "is a system or shared directory" in workspace_problem(Path(where), must_exist=False)


@pytest.mark.parametrize("where", ["/home/alice/project", "/var/lib/jenkins/workspace/job", "/srv/app",
                                   "/tmp/pytest-of-x/test0", "/opt/project"])
def test_a_project_folder_is_fine(where):
    assert workspace_problem(Path(where), must_exist=False) is None


def call_in(workspace: str) -> tuple[ToolInvocation, object]:
    catalog = Catalog()

    @tool(catalog=catalog, name="noop")
    def noop(args: FunctionPayload, ctx: ToolContext) -> str:
        """Nothing."""
        return "ran"

    spec = catalog.get(ToolName.plain("noop"))
    inv = ToolInvocation(turn_id="t", step=0, output_index=0, call_id="c", tool_name=ToolName.plain("noop"),
                         payload=FunctionPayload(arguments="{}"), deadline=time.time() + 30, workspace=workspace,
                         spec_digest=spec.digest())
    return inv, spec


def test_the_worker_refuses_a_workspace_that_became_a_link_to_etc_after_the_turn_began(tmp_path):
    """A red-team helper's `Session(workspace=X)`, then X made a symlink to /etc: the commands wrote there."""
    inv, spec = call_in(str(tmp_path / "late"))
    (tmp_path / "late").symlink_to("/etc")
    state, output, _ = refusal(inv, spec, "w1")
    assert state is CallState.REJECTED and output.startswith(f"workspace {tmp_path / 'late'} is a system or shared")
    assert output.endswith("; not run on worker w1")


def test_the_worker_refuses_a_relative_workspace_and_runs_a_project_folder(tmp_path):
    inv, spec = call_in("tmp")  # a forged resumed turn's: the worker would read it against its own folder
    assert refusal(inv, spec, "w1")[1] == "workspace tmp is not an absolute path; not run on worker w1"
    inv, spec = call_in(str(tmp_path))
    assert refusal(inv, spec, "w1") is None


def test_a_link_loop_is_refused_not_raised(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert workspace_problem(tmp_path / "loop").startswith(f"workspace {tmp_path / 'loop'} cannot be resolved")


@pytest.fixture
def password_database(monkeypatch):
    """Stand-in users for the workspace rules (their homes are read once per process)."""
    import pwd

    from toolq.core import settings

    def users(*entries: tuple[str, str]) -> None:
        rows = [pwd.struct_passwd((name, "x", 1000 + i, 1000 + i, "", home, "/bin/bash"))
                for i, (name, home) in enumerate(entries)]
        monkeypatch.setattr(settings.pwd, "getpwall", lambda: rows)
        settings._homes.cache_clear()

    yield users
    settings._homes.cache_clear()


def test_a_users_home_outside_home_or_a_folder_holding_one_is_refused(password_database):
    # Red team: homes outside /home (postgres', www-data's, a site's /data/users/bob) were accepted,
    # and a command writes the dotfiles that run at that user's next login.
    password_database(("postgres", "/var/lib/postgresql"), ("bob", "/data/users/bob/"), ("daemon", "/"))
    for where, home in [("/var/lib/postgresql", "/var/lib/postgresql"), ("/data/users/bob", "/data/users/bob"),
                        ("/data", "/data/users/bob"), ("/data/users", "/data/users/bob")]:
        problem = workspace_problem(Path(where), must_exist=False)
        assert problem and f"is or holds a user's home ({home})" in problem, (where, problem)
    for fine in ("/var/lib/postgresql/project", "/data/users/bob/project", "/data/other", "/srv/app"):
        assert workspace_problem(Path(fine), must_exist=False) is None, fine


def test_a_home_behind_a_link_is_refused_where_the_link_leads(password_database, tmp_path):
    # /home may be a link to /data/home: the home as written and where it leads are both homes.
    (tmp_path / "data/home/ann").mkdir(parents=True)
    (tmp_path / "home").symlink_to(tmp_path / "data/home")
    password_database(("ann", str(tmp_path / "home/ann")))
    problem = workspace_problem(tmp_path / "data/home/ann")
    assert problem and f"is or holds a user's home ({tmp_path / 'data/home/ann'})" in problem, problem
    (tmp_path / "data/home/ann/project").mkdir()
    assert workspace_problem(tmp_path / "data/home/ann/project") is None
