"""The environments API's pure parts (issue 28): what the model is told after its host died, and
the sources the API's keywords name."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolq.core.environments import EnvironmentRecord, EnvSource
from toolq.orchestrator.environments import (
    Environment,
    EnvironmentRefused,
    Upload,
    environment_record,
    lost_note,
    pending_source,
)


def record(**kw) -> EnvironmentRecord:
    return EnvironmentRecord(id="env_1", host="box-b", source=EnvSource(kind="empty"), base="empty",
                             owner="toolq:conv:c", **kw)


def test_the_model_is_told_which_host_died_where_it_goes_on_and_what_was_lost():
    note = lost_note(record(checkpoint="c" * 64), "box-a")
    assert "box-a" in note and "box-b" in note and "c" * 64 in note
    assert "process" in note and "changes made since that checkpoint were lost" in note


def test_with_no_checkpoint_the_model_is_told_it_starts_from_the_source_again():
    note = lost_note(record(), "box-a")
    assert "no checkpoint" in note and "starting files" in note


def test_a_folder_is_packed_when_the_handle_opens_and_a_packed_upload_is_used_as_it_is():
    assert pending_source("some/folder") == Path("some/folder")
    packed = Upload(EnvSource(kind="upload", blob="b" * 64), {})
    assert pending_source(packed) == packed.source
    assert pending_source(git="https://example.org/r.git@v1").git.ref == "v1"
    with pytest.raises(EnvironmentRefused):
        pending_source(packed, checkpoint="c" * 64)


def test_a_call_is_routed_by_a_record_or_a_made_handle_and_never_by_an_unmade_one():
    r = record()
    assert environment_record(r) is r and environment_record(None) is None
    handle = Environment.__new__(Environment)
    handle.record = None
    with pytest.raises(RuntimeError, match="not made yet"):
        environment_record(handle)
    handle.record = r
    assert environment_record(handle) is r


def test_a_token_in_a_git_url_is_not_in_the_label_toolq_envs_shows():
    from toolq.orchestrator.environments import source_of

    source = source_of(git="https://user:s3cret@example.org/r.git@main")
    assert "s3cret" not in source.label and source.label == "https://***@example.org/r.git@main"
    assert source.git.url == "https://user:s3cret@example.org/r.git"  # the host still needs it to clone
    assert source_of(git="git@github.com:o/r.git").label == "git@github.com:o/r.git@HEAD"


@pytest.mark.parametrize("where", ["/etc", "/", "home"])
def test_an_upload_of_a_system_folder_or_a_home_is_refused_before_anything_is_packed(where):
    """The model reads every uploaded file (a home's keys) and --apply writes back: an upload may
    not be what a shared workspace may not be (newcomer's finding: `--upload ~` only hit the caps)."""
    import asyncio

    from toolq.core.settings import Settings
    from toolq.orchestrator.environments import Environments

    where = str(Path.home()) if where == "home" else where
    # never reached: no Redis, and caps that end a pack at once were the check ever to let it through
    envs = Environments(None, Settings(upload_max_files=5), None, catalog=object())  # type: ignore[arg-type]
    with pytest.raises(EnvironmentRefused, match=r"^cannot upload .*(system or shared|home)"):
        asyncio.run(envs.upload(Path(where)))


def test_an_upload_holding_toolqs_import_path_is_refused(tmp_path, monkeypatch):
    """--apply would write the model's changes into code toolq imports outside any sandbox."""
    import asyncio
    import sys

    from toolq.core.settings import Settings
    from toolq.orchestrator.environments import Environments

    (tmp_path / "venv" / "lib").mkdir(parents=True)
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path / "venv" / "lib")])
    envs = Environments(None, Settings(), None, catalog=object())  # type: ignore[arg-type]
    with pytest.raises(EnvironmentRefused, match="import path"):
        asyncio.run(envs.upload(tmp_path))


def test_a_session_in_an_environment_never_checks_the_shared_workspace_it_does_not_use():
    """From a home or a project holding toolq's venv, `Session(upload=...)` was refused although no
    call of it runs there (newcomer's finding; `Fleet.run_calls(environment=)` likewise)."""
    from types import SimpleNamespace

    from toolq.core.errors import ConfigurationError
    from toolq.core.settings import Settings
    from toolq.orchestrator.turn import Session

    settings = Settings(workspace=Path("/"))
    runtime = SimpleNamespace(settings=settings, fleet=SimpleNamespace(ledger=SimpleNamespace(r=None)),
                              client=SimpleNamespace(settings=SimpleNamespace(model="gpt-5")))
    with pytest.raises(ConfigurationError, match="system or shared"):
        Session(runtime)  # type: ignore[arg-type]
    assert Session(runtime, environment=record()).environment is not None  # type: ignore[arg-type]
    assert Session(runtime, from_checkpoint="c" * 64)  # type: ignore[arg-type]
