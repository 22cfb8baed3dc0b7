"""The benchmarks run end to end at a tiny size (they are code too). No timing is asserted:
the figures are printed by `toolq bench`, not judged here."""

import io

import pytest

from toolq.orchestrator.bench import cancel, pipeline, steps

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
    res = steps.run(io.StringIO(), sizes=(2,), steps=2)
    assert res[2]["p50"] > 0


def test_cancel_bench_cancels_every_run():
    res = cancel.run(io.StringIO(), runs=2)
    assert res["runs"] == 2 and res["p50"] > 0
