"""Where a new environment goes (issue 28 item 2): pure, from the hosts' adverts."""

from __future__ import annotations

import pytest

from toolq.core.calls import FunctionPayload, ToolInvocation, ToolName
from toolq.core.catalog import ToolSpec
from toolq.core.environments import EMPTY_BASE, EnvRef, HostAdvert
from toolq.orchestrator.environments import (
    EnvironmentRefused,
    choose_host,
    parse_git,
    pending_source,
    source_of,
)
from toolq.orchestrator.transport.dispatch import call_queue

BASE = "a" * 64


def host(name: str, *, bases: list[str] = (), envs: int = 0, used: int = 0, cap: int = 0) -> HostAdvert:
    return HostAdvert(host=name, mode="overlay", bases=list(bases), environments=envs, used_bytes=used,
                      cap_bytes=cap)


def test_no_host_advertising_gives_none():
    assert choose_host([], BASE) is None


def test_a_host_holding_the_base_is_chosen_though_it_keeps_more_environments():
    adverts = [host("idle", envs=0), host("holder", bases=[BASE], envs=5)]
    assert choose_host(adverts, BASE) == "holder"


def test_among_hosts_without_the_base_the_least_loaded_is_chosen():
    adverts = [host("busy", envs=7), host("quiet", envs=1), host("middling", envs=3)]
    assert choose_host(adverts, BASE) == "quiet"


def test_among_hosts_holding_the_base_the_least_loaded_is_chosen():
    adverts = [host("h1", bases=[BASE], envs=4), host("h2", bases=[BASE], envs=2), host("h3", envs=0)]
    assert choose_host(adverts, BASE) == "h2"


def test_a_git_source_whose_base_is_unknown_goes_to_the_least_loaded_host():
    adverts = [host("holder", bases=[BASE], envs=5), host("idle", envs=0)]
    assert choose_host(adverts, None) == "idle"


def test_ties_are_broken_by_host_id_so_the_choice_is_stable():
    adverts = [host("b"), host("a"), host("c")]
    assert choose_host(adverts, EMPTY_BASE) == "a"
    assert choose_host(list(reversed(adverts)), EMPTY_BASE) == "a"


def test_a_host_past_its_disk_cap_is_chosen_only_when_every_host_is():
    assert choose_host([host("full", bases=[BASE], used=10, cap=10), host("room", envs=9, cap=10)], BASE) == "room"
    assert choose_host([host("full", used=10, cap=10), host("fuller", used=20, cap=10, envs=1)], BASE) == "full"


def test_a_host_to_avoid_is_taken_only_when_no_other_lives():
    adverts = [host("dead", bases=[BASE]), host("other", envs=3)]
    assert choose_host(adverts, BASE, avoid=["dead"]) == "other"
    assert choose_host([host("dead")], BASE, avoid=["dead"]) == "dead"


def test_one_source_only():
    assert source_of().kind == "empty"
    assert source_of(checkpoint="c" * 64).checkpoint == "c" * 64
    with pytest.raises(EnvironmentRefused, match="one source"):
        source_of(git="https://example.org/r.git", checkpoint="c" * 64)
    with pytest.raises(EnvironmentRefused, match="one source"):
        pending_source("some/folder", git="https://example.org/r.git")


@pytest.mark.parametrize(("spec", "url", "ref"), [
    ("https://example.org/r.git", "https://example.org/r.git", "HEAD"),
    ("https://example.org/r.git@v1.2", "https://example.org/r.git", "v1.2"),
    ("git@github.com:o/r.git", "git@github.com:o/r.git", "HEAD"),
    ("git@github.com:o/r.git@main", "git@github.com:o/r.git", "main"),
    ("https://user@example.org/r.git", "https://user@example.org/r.git", "HEAD"),
])
def test_git_specs_name_the_url_and_the_ref(spec, url, ref):
    assert (parse_git(spec).url, parse_git(spec).ref) == (url, ref)


def test_a_call_of_an_environment_goes_to_its_hosts_queue_and_others_to_the_tools():
    spec = ToolSpec(name="exec_command", description="", parameters={"type": "object", "properties": {}})
    inv = ToolInvocation(turn_id="t", step=0, output_index=0, call_id="c", tool_name=ToolName.plain("exec_command"),
                         payload=FunctionPayload(arguments="{}"), deadline=0.0, spec_digest=spec.digest())
    plain = call_queue(inv, spec)
    assert plain.startswith("toolq.t.exec_command.")
    placed = call_queue(inv.model_copy(update={"environment": EnvRef(id="env_1", host="box-2")}), spec)
    assert placed == "toolq.h.box-2." + plain.removeprefix("toolq.t.")
