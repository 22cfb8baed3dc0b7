"""The benchmarks' printouts: a figure that misses its goal says so (no timing is judged here)."""

from toolq.dev.bench import limits, pipeline, steps
from toolq.dev.bench.harness import START_BENCH_WORKER, goal, missing_queues_line


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
    assert "Codex is not installed (npm install -g @openai/codex@0.171.0)" in lines[0]
    assert lines[1].endswith("= 0.51x Codex's fixed 59 ms (goal <= 1x: met)")
    assert lines[2].endswith("= 0.62x Codex's fixed 322 ms (goal <= 0.35x: MISSED)")
    assert "goal" not in lines[3]  # Codex was not measured at 2 calls: no goal to miss
    assert (results[1]["goal_met"], results[32]["goal_met"]) == (True, False)


def test_steps_printout_compares_with_codex_measured_in_the_same_run_both_ways():
    toolq, codex = {"p50": 0.100, "p90": 0.12}, {"p50": 0.400, "p90": 0.45}
    results = {32: {**toolq, "codex": codex, "unsandboxed": {"toolq": {"p50": 0.090}, "codex": {"p50": 0.200}}}}
    lines = steps.report(results, 10, "/opt/codex", "bwrap")
    assert "sandbox bwrap" in lines[0] and "Codex 0.171.0 (/opt/codex)" in lines[0]
    assert "= 0.25x Codex in its sandbox 400 ms (goal <= 0.35x: met)" in lines[1]
    assert lines[1].endswith("unsandboxed 90.00 ms  = 0.45x Codex unsandboxed 200 ms (goal <= 0.35x: MISSED)")
    assert results[32]["goal_met"] and not results[32]["unsandboxed"]["goal_met"]


def test_steps_printout_says_when_codex_could_not_run_and_judges_nothing():
    results = {32: {"p50": 0.100, "p90": 0.12, "codex": {"failed": "codex exec exited 1: bwrap: no permission"}}}
    line = steps.report(results, 10, "/opt/codex", "landlock")[1]
    assert line.endswith("(Codex in its sandbox: could not run here: codex exec exited 1: bwrap: no permission)")
    assert "goal_met" not in results[32]
    unsandboxed = {32: {"p50": 0.100, "p90": 0.12, "codex": {"p50": 0.3}}}  # toolq itself ran unsandboxed
    assert "= 0.33x Codex unsandboxed 300 ms" in steps.report(unsandboxed, 10, "/opt/codex", "none")[1]


def test_a_fleet_without_bench_workers_is_told_what_to_start():
    line = missing_queues_line(["toolq-bench"], 2)
    assert "\n" not in line and "queue toolq-bench" in line and "2 worker(s) answered" in line
    assert START_BENCH_WORKER in line and START_BENCH_WORKER == "toolq worker --tools toolq.dev.bench.tools"


def test_limits_printout_marks_a_slowed_fleet_or_a_third_running_call_missed():
    base = {"rounds": 3, "alone": 100.0, "beside": 97.0, "ratio": 0.97, "cpu_alone": 0.0016, "cpu_beside": 0.0017,
            "ms": 500}
    lines = limits.report({**base, "peak": 2})
    assert "(goal <= 2: met)" in lines[1] and lines[4].endswith("0.97x   (goal >= 0.9x: met)")
    res = {**base, "peak": 3}
    assert "(goal <= 2: MISSED)" in limits.report(res)[1] and res["goal_met"] is False
    slow = {**base, "peak": 2, "beside": 50.0, "ratio": 0.5}
    assert limits.report(slow)[4].endswith("(goal >= 0.9x: MISSED)") and slow["goal_met"] is False


def test_max_running_counts_overlaps_and_a_finish_before_a_start_at_the_same_instant():
    assert limits.max_running([(0, 2), (1, 3), (2, 4)]) == 2
    assert limits.max_running([(0, 1), (1, 2)]) == 1 and limits.max_running([]) == 0


def test_coldstart_printout_marks_each_goal():
    from toolq.dev.bench import coldstart

    res = {"runs": 3, "imports": 0.15, "imports_load_celery": False,
           "external": {"first_request": 0.2, "exit": 0.3, "cpu": 0.2},
           "embedded": {"first_request": 0.25, "exit": 0.8, "cpu": 0.5},
           "embedded_call": {"first_request": 0.25, "exit": 1.8, "after_last_request": 0.7, "cpu": 0.9},
           "warm_call": {"first_request": 0.2, "exit": 0.52, "after_last_request": 0.02, "cpu": 0.3}}
    lines = coldstart.report(res)
    assert "1.11x Codex's fixed 0.27 s (npm install -g @openai/codex@0.171.0 to measure it here) (goal <= 1x: MISSED)" in lines[1]
    assert "(goal < 1 s: met)" in lines[2] and "0.700 s from the last request to exit" in lines[3] and "no Celery" in lines[5]
    assert "warm, 1 call" in lines[4] and "= 2.00x Codex's one-call turn, fixed 0.26 s (goal <= 1.5x: MISSED)" in lines[4]
    assert res["goal_met"] is False and res["warm_goal_met"] is False
    assert not any("floor" in line for line in lines)  # not measured: not printed


def test_coldstart_printout_sets_the_floor_beside_codex():
    from toolq.dev.bench import coldstart

    res = {"runs": 3, "imports": 0.25, "imports_load_celery": False,
           "external": {"first_request": 0.34, "exit": 0.36, "cpu": 0.35},
           "embedded": {"first_request": 0.6, "exit": 0.75, "cpu": 0.9},
           "embedded_call": {"first_request": 0.6, "exit": 3.1, "after_last_request": 0.9, "cpu": 3.4},
           "warm_call": {"first_request": 0.2, "exit": 0.35, "after_last_request": 0.02, "cpu": 0.3},
           "codex_call": {"first_request": 0.17, "exit": 0.26, "after_last_request": 0.07, "cpu": 0.33},
           "codex": {"first_request": 0.17, "exit": 0.24, "after_last_request": 0.07, "cpu": 0.33},
           "codex_path": "/bin/codex", "floor": {"interpreter": 0.02, "libraries": 0.16}}
    floor = next(line for line in coldstart.report(res) if "floor" in line)
    assert floor.endswith("python -c pass 20 ms + the core libraries' imports (asyncio, redis-py, pydantic, httpx) "
                          "160 ms = 180 ms, 0.75x of Codex's whole turn")
    warm = next(line for line in coldstart.report(res) if "warm, 1 call" in line)
    assert "= 1.35x Codex's one-call turn 0.260 s in the same runs (goal <= 1.5x: met)" in warm


def test_history_printout_compares_the_last_step_with_the_first():
    from toolq.dev.bench import history

    step = {"around": 0.002, "inside": 0.003, "wall": 0.04}
    res = {"steps": 200, "window": 10, "at": {1: step, 200: {**step, "around": 0.0023}}}
    assert history.report(res)[-1] == "  CPU around the request, step 200 / step 1: 1.15x (goal <= 1.2x: met)"


def test_callcpu_counts_each_process_kind_per_call_and_reads_this_process():
    from toolq.dev.bench import callcpu

    before = {1: ("pool child", 1.0, 0.0), 2: ("session host", 2.0, 5.0)}
    after = {1: ("pool child", 1.5, 0.0), 2: ("session host", 2.25, 5.5), 3: ("pool child", 0.25, 0.0)}
    res = callcpu.per_call(before, after, calls=250)
    assert res["pool child"] == (3.0, 0.0) and res["session host"] == (1.0, 2.0) and res["redis"] == (0.0, 0.0)
    lines = callcpu.report([res], 32)
    assert "session host  1.00   + 2.00 commands" in lines[4] and lines[-1].endswith("4.00")
    mine = callcpu.snapshot()
    assert [k for k, *_ in mine.values()].count("orchestrator") == 1  # /proc, this process included


def test_the_codex_baseline_is_its_native_binary_not_the_npm_wrapper(tmp_path, monkeypatch):
    from toolq.dev.bench import codex

    scope = tmp_path / "node_modules" / "@openai"
    wrapper = scope / "codex" / "bin" / "codex.js"
    native = scope / "codex-linux-x64" / "vendor" / "x86_64-unknown-linux-musl" / "bin" / "codex"
    for path, text in ((wrapper, "#!/usr/bin/env node\n"), (native, "\x7fELF")):
        path.parent.mkdir(parents=True)
        path.write_text(text)
        path.chmod(0o755)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "codex").symlink_to(wrapper)
    monkeypatch.delenv("TOOLQ_BENCH_CODEX", raising=False)
    monkeypatch.setattr(codex, "CACHE", tmp_path / "no-install")  # not the copy the tests installed
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert codex.binary() == str(native)  # node's start-up is not counted against Codex
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert codex.binary() is None and "npm install -g @openai/codex@0.171.0" in codex.describe(None)
    monkeypatch.setattr(codex, "CACHE", tmp_path)  # what `install()` put there (npm install --prefix)
    assert codex.binary() == str(native)
    monkeypatch.setenv("TOOLQ_BENCH_CODEX", str(tmp_path / "missing"))
    assert codex.binary() is None
    native.unlink()  # the wrapper alone would count node's start-up against Codex
    monkeypatch.setenv("TOOLQ_BENCH_CODEX", str(wrapper))
    assert codex.binary() is None


def test_exec_server_printout_gives_both_step_times_and_marks_a_missed_ratio():
    from toolq.dev.bench import exec_server

    res = {"parallel": 8, "cpus": 2, "load": 1.0, "quick": False, "sizes": {"rounds": 9}, "failed": [],
           "codex": {"p50": 0.2, "cpu_per_turn": 0.1}, "toolq": {"p50": 0.32, "cpu_per_turn": 0.3},
           "toolq_cpu_per_turn": {"toolq exec-server": 0.07, "redis": 0.02, "workers": 0.21}, "ratio": 1.6}
    lines = exec_server.report(res)
    assert "p50 200 ms" in lines[1] and "p50 320 ms" in lines[2] and "workers 210" in lines[2]
    assert lines[-1] == "  ratio 1.60x  (goal <= 1.5x: MISSED)"
    failed = exec_server.report({**res, "failed": ["CodexFailed: npm is not installed, so Codex 0.171.0 cannot be"]})
    assert failed[1:] == ["  FAILED: CodexFailed: npm is not installed, so Codex 0.171.0 cannot be"]


def test_codex_install_says_in_one_line_why_it_cannot(tmp_path, monkeypatch):
    import pytest

    from toolq.dev.bench import codex

    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(codex.CodexFailed, match="^npm is not installed, so Codex 0.171.0 cannot be$"):
        codex.install(tmp_path / "prefix")
    (tmp_path / "bin").mkdir()
    npm = tmp_path / "bin" / "npm"
    npm.write_text("#!/bin/sh\necho 'npm error code ENOTFOUND' >&2\necho 'npm error network request failed' >&2\n"
                   "exit 1\n")
    npm.chmod(0o755)
    with pytest.raises(codex.CodexFailed) as e:
        codex.install(tmp_path / "prefix")
    assert str(e.value) == "npm install @openai/codex@0.171.0 failed: npm error network request failed"
