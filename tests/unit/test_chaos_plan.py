"""The fault campaign's plans (toolq/dev/bench/chaos.py): seeded, every fleet fault met
in a short campaign, each turn's evidence counts matching its script."""

from collections import Counter

import pytest

from toolq.cli import main as cli
from toolq.dev.bench import chaos


def steps(response) -> list:
    return response["output"] if isinstance(response, dict) else response


def calls_of(script: list) -> Counter:
    return Counter(i["call_id"] for response in script for i in steps(response) if i.get("type") == "function_call")


def test_a_seed_gives_the_same_plans_and_another_seed_others():
    def plans(seed):
        p = chaos.Planner(seed)
        return [(x.shape, x.stream, x.fleet, x.counts) for x in (p.plan(t) for t in range(12))]

    assert plans(7) == plans(7) and plans(7) != plans(8)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_every_fleet_fault_and_shape_comes_up_in_one_round(seed):
    p = chaos.Planner(seed)
    turns = [p.plan(t) for t in range(len(chaos.FLEET_FAULTS))]
    assert sorted(t.fleet for t in turns) == sorted(chaos.FLEET_FAULTS)
    assert {t.shape for t in turns[:len(chaos.SHAPES)]} == set(chaos.SHAPES)


@pytest.mark.parametrize("seed", range(6))
def test_each_plan_counts_the_calls_its_script_makes(seed):
    p = chaos.Planner(seed)
    for t in range(12):
        plan = p.plan(t)
        assert calls_of(plan.script) == Counter(plan.counts), plan
        if plan.shape == "wide":
            assert sum(n for c, n in plan.counts.items() if "_hang" not in c and "_flood" not in c) == chaos.WIDE
        if plan.fleet == "kill_orchestrator_mid_stream":  # the stream stops at a gate, never completes
            assert any(d.get("directive") == "gate" for r in plan.script for d in steps(r))
            assert plan.stream in ("none", "500", "429")


def test_seeds_are_a_number_or_a_range():
    assert chaos.parse_seeds("4") == [4] and chaos.parse_seeds("1..3") == [1, 2, 3]


def test_a_bad_seed_is_one_line_and_exit_2(capsys):
    assert cli.main(["bench", "chaos", "--seed", "one"]) == 2
    assert capsys.readouterr().err.strip() == (
        "toolq bench: --seed takes a number or a range such as 1..3, not 'one'")


def test_the_campaign_is_not_part_of_a_plain_toolq_bench():
    assert "chaos" not in cli.BENCHMARKS and "chaos" in cli.CAMPAIGNS


def test_the_suites_deck_meets_each_fault_once():
    p = chaos.Planner(5, chaos.FLEET_FAULTS)
    fleet = [p.plan(t).fleet for t in range(len(chaos.FLEET_FAULTS))]
    assert sorted(fleet) == sorted(chaos.FLEET_FAULTS)


@pytest.mark.parametrize("seed", range(6))
def test_held_and_stalled_responses_are_scripted_where_their_fault_needs_them(seed):
    p = chaos.Planner(seed)
    for t in range(22):
        plan = p.plan(t)
        first = plan.script[-2]  # the response with the calls (after any 500/429)
        directives = [i.get("directive") for i in steps(first)]
        if plan.fleet in chaos.HELD:  # a stream fault at the end would never be reached
            assert plan.stream in ("none", "500", "429")
        if plan.fleet == "cancel_before_start":  # the silence comes before any call, short of the idle timeout
            assert directives[0] == "stall" and steps(first)[0]["seconds"] < chaos.IDLE_TIMEOUT
        elif plan.stream == "stall":  # longer than the client's idle timeout, after the calls
            assert directives[-1] == "stall" and steps(first)[-1]["seconds"] > chaos.IDLE_TIMEOUT
