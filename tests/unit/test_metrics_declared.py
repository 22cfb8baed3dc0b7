"""The metric declarations (`toolq/core/metrics.py`): the design's names, kinds and labels, and
bounded labels only."""

from __future__ import annotations

import re

from toolq.core import metrics

DESIGN = {
    "gen_ai_execute_tool_duration_seconds": ("histogram", ("tool", "state")),
    "toolq_tool_run_seconds": ("histogram", ("tool", "queue")),
    "toolq_queue_wait_seconds": ("histogram", ("queue", "tool")),
    "toolq_queue_depth": ("gauge", ("queue",)),
    "toolq_calls_total": ("counter", ("tool", "state", "reason")),
    "toolq_sandbox_start_seconds": ("histogram", ("backend",)),
    "toolq_cancel_to_dead_seconds": ("histogram", ("tool",)),
    "toolq_turns_in_flight": ("gauge", ()),
    "toolq_turns_total": ("counter", ("state",)),
    "toolq_model_requests_total": ("counter", ("outcome",)),
    "toolq_sessions_in_flight": ("gauge", ()),
    "toolq_limit_wait_seconds": ("histogram", ("limit", "tool")),
    "toolq_environments": ("gauge", ("state",)),
    "toolq_workspace_bytes": ("gauge", ()),
    "toolq_worker_tasks_total": ("counter", ("tool", "outcome")),
}
BOUNDED = {"tool", "state", "reason", "queue", "backend", "outcome", "limit"}


def test_the_declarations_are_the_designs_table() -> None:
    assert {m.name: (m.kind, m.labels) for m in metrics.METRICS} == DESIGN
    assert len(metrics.BY_NAME) == len(metrics.METRICS)


def test_names_follow_prometheus_conventions() -> None:
    for m in metrics.METRICS:
        assert re.fullmatch(r"[a-z_][a-z0-9_]*", m.name), m.name
        assert m.name.endswith("_total") == (m.kind == "counter"), m.name
        if m.kind == "histogram":
            assert m.name.endswith("_seconds") and m.buckets, m.name
            assert list(m.buckets) == sorted(set(m.buckets)), m.name
        else:
            assert not m.buckets, m.name
        assert m.help and "\n" not in m.help
        assert set(m.labels) <= BOUNDED, m.labels


def test_base_and_scraped_names() -> None:
    assert metrics.CALLS.base_name == "toolq_calls"
    assert metrics.TURNS_IN_FLIGHT.base_name == "toolq_turns_in_flight"
    assert metrics.scraped_names(metrics.QUEUE_WAIT) == (
        "toolq_queue_wait_seconds_bucket", "toolq_queue_wait_seconds_count", "toolq_queue_wait_seconds_sum")


def test_operating_md_documents_every_metric_with_its_labels() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "operating.md").read_text()
    section = doc.split("\n## Traces and metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and re.fullmatch(r"`[a-z_]+`", cells[0]):
            labels = tuple(re.findall(r"`([a-z_]+)`", cells[2]))
            rows[cells[0].strip("`")] = (cells[1], labels, cells[3])
    assert rows == {m.name: (m.kind, m.labels, m.side) for m in metrics.METRICS}
