"""The benchmarks' printouts: a figure that misses its goal says so (no timing is judged here)."""

from toolq.orchestrator.bench import pipeline, steps
from toolq.orchestrator.bench.harness import START_BENCH_WORKER, goal, missing_queues_line


def test_goal_is_met_at_the_limit_and_missed_past_it():
    assert goal(1.2, 1.2) == (True, "goal <= 1.2x: met")
    assert goal(1.21, 1.2) == (False, "goal <= 1.2x: MISSED")
    assert goal(0.9, 1.0, at_least=True) == (False, "goal >= 1x: MISSED")
    assert goal(4.1, 1.0, at_least=True) == (True, "goal >= 1x: met")


def test_pipeline_printout_marks_a_missed_ratio():
    res = {"calls": 300, "baseline_p50": 0.004, "baseline_p90": 0.005, "toolq_p50": 0.006, "toolq_p90": 0.007,
           "ratio_p50": 1.5}
    lines = pipeline.report(res)
    assert lines[-1].endswith("1.50x   (goal <= 1.2x: MISSED)")
    assert res["goal_met"] is False


def test_steps_printout_marks_each_size_met_or_missed():
    results = {1: {"p50": 0.030, "p90": 0.04}, 32: {"p50": 0.200, "p90": 0.25}, 2: {"p50": 0.02, "p90": 0.03}}
    lines = steps.report(results, 10)
    assert lines[1].endswith("= 0.51x Codex's 59 ms (goal <= 1x: met)")
    assert lines[2].endswith("= 0.62x Codex's 322 ms (goal <= 0.5x: MISSED)")
    assert "goal" not in lines[3]  # Codex was not measured at 2 calls: no goal to miss
    assert (results[1]["goal_met"], results[32]["goal_met"]) == (True, False)


def test_a_fleet_without_bench_workers_is_told_what_to_start():
    line = missing_queues_line(["toolq-bench"], 2)
    assert "\n" not in line and "queue toolq-bench" in line and "2 worker(s) answered" in line
    assert START_BENCH_WORKER in line and START_BENCH_WORKER == "toolq worker --tools toolq.orchestrator.bench.tools"


def test_callcpu_counts_each_process_kind_per_call_and_reads_this_process():
    from toolq.orchestrator.bench import callcpu

    before = {1: ("pool child", 1.0, 0.0), 2: ("session host", 2.0, 5.0)}
    after = {1: ("pool child", 1.5, 0.0), 2: ("session host", 2.25, 5.5), 3: ("pool child", 0.25, 0.0)}
    res = callcpu.per_call(before, after, calls=250)
    assert res["pool child"] == (3.0, 0.0) and res["session host"] == (1.0, 2.0) and res["redis"] == (0.0, 0.0)
    lines = callcpu.report([res], 32)
    assert "session host  1.00   + 2.00 commands" in lines[4] and lines[-1].endswith("4.00")
    mine = callcpu.snapshot()
    assert [k for k, *_ in mine.values()].count("orchestrator") == 1  # /proc, this process included
