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
