"""The benchmarks run end to end at a tiny size (they are code too). No timing is asserted:
the figures are printed by `toolq bench`, not judged here."""

import io

import pytest

from toolq.dev.bench import cancel, coldstart, history, limits, pipeline, steps, streaming, throughput

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def embedded(monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)  # the benchmarks start their own stack


def test_pipeline_bench_measures_both_paths():
    out = io.StringIO()
    res = pipeline.run(out, rounds=1, per_round=5)
    assert res["calls"] == 5 and res["baseline_p50"] > 0 and res["toolq_p50"] > 0
    assert "ratio toolq/bare" in out.getvalue()


def test_steps_bench_reports_each_size():
    out = io.StringIO()
    res = steps.run(out, sizes=(2,), steps=2, telemetry_rounds=1)
    assert res[2]["p50"] > 0
    # the telemetry comparison: traces reached the loopback receiver, both modes timed
    assert res["telemetry"]["spans"] > 0 and res["telemetry"]["2"]["on"] > 0 and res["telemetry"]["2"]["off"] > 0
    assert "telemetry on" in out.getvalue() and isinstance(res["telemetry"]["goal_met"], bool)


def test_streaming_bench_measures_both_modes_in_one_run():
    out = io.StringIO()
    res = streaming.run(out, sizes=(2,), steps=2, rounds=1)
    assert res["2"]["on"] > 0 and res["2"]["off"] > 0 and "streaming on vs off" in out.getvalue()
def test_limits_bench_counts_the_limited_tool_running_and_both_rates():
    res = limits.run(io.StringIO(), rounds=1, duration=0.3, ms=100)
    assert res["peak"] == limits.LIMIT and res["alone"] > 0 and res["beside"] > 0


def test_throughput_bench_measures_both_paths_at_each_k():
    out = io.StringIO()
    res = throughput.run(out, ks=(1, 2), rounds=1, calls_per_round=8, telemetry_rounds=1)
    assert set(res["ks"]) == {1, 2} and res["ks"][2]["toolq"]["calls"] == 2 * 2 * 4
    assert res["ks"][2]["bare"]["calls_per_s"] > 0 and isinstance(res["goal_met"], bool)
    assert "toolq/bare  : calls/s" in out.getvalue() and "per turn over K=1" in out.getvalue()
    telemetry = res["telemetry"]
    assert telemetry["spans"] > 0 and telemetry["ks"][2]["on"]["calls"] == telemetry["ks"][2]["off"]["calls"] > 0


def test_cancel_bench_cancels_every_run():
    res = cancel.run(io.StringIO(), runs=2)
    assert res["runs"] == 2 and res["p50"] > 0


def test_coldstart_bench_times_both_stacks_and_says_whether_each_goal_is_met():
    out = io.StringIO()
    res = coldstart.run(out, runs=1)
    for where in ("external", "embedded", "warm_call"):
        assert 0 < res[where]["first_request"] < res[where]["exit"]
    assert not res["imports_load_celery"]
    text = out.getvalue()
    assert ("Codex's fixed 0.27 s" in text or "in the same runs" in text) and ("met" in text or "MISSED" in text)


def test_history_bench_reports_each_checkpoint():
    res = history.run(io.StringIO(), steps=4, window=2)
    assert list(res["at"]) == [1, 4] and res["ratio"] > 0 and len(res["samples"]["around"]) == 4


# --- on one's own fleet (REDIS_URL set) ------------------------------------------------------


@pytest.fixture
def own_redis(monkeypatch):
    """A fleet's broker of its own, so no shared worker answers for it."""
    from toolq.local.embedded import RedisServer

    with RedisServer() as server:
        monkeypatch.setenv("REDIS_URL", server.url)
        yield server


def test_bench_on_a_fleet_without_bench_workers_says_in_one_line_what_to_start(own_redis, capsys):
    from toolq.cli import main as cli

    assert cli.main(["bench", "pipeline", "steps"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "toolq bench pipeline: no worker on REDIS_URL consumes queue toolq-bench (no worker answered); "
        "start one with `toolq worker --tools toolq.dev.bench.tools` on that broker",
        "toolq bench steps: no worker on REDIS_URL consumes queue toolq (no worker answered); "
        "start one with `toolq worker --tools toolq.dev.bench.tools` on that broker",
    ]


def test_pipeline_bench_runs_on_a_fleet_whose_worker_loads_the_bench_tools(own_redis, tmp_path):
    from toolq.dev.bench.harness import BENCH_TOOLS
    from toolq.local.embedded import WorkerProcess

    worker = WorkerProcess(own_redis.url, tools=[BENCH_TOOLS], logdir=tmp_path, name="bench1@test").start()
    try:
        res = pipeline.run(io.StringIO(), rounds=1, per_round=3)
    finally:
        worker.stop()
    assert res["calls"] == 3 and res["toolq_p50"] > 0 and isinstance(res["goal_met"], bool)
