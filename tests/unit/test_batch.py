"""`toolq batch`'s input lines, keys and results file (pure parts; the runs are in
tests/integration/test_batch.py)."""

import asyncio
import json
import os

import pytest

from toolq.cli.batch import (
    BatchResult,
    Results,
    compact,
    latest_statuses,
    line_key,
    read_entries,
    read_lines,
    replace_durably,
    run_batch,
    where,
)
from toolq.core.errors import ConfigurationError
from toolq.core.settings import Settings


def test_each_line_is_a_turn_or_one_line_naming_every_problem(tmp_path):
    lines = ['{"prompt": "hi"}', "", "not json", '{"promt": "typo"}', '{"prompt": ""}',
             json.dumps({"prompt": "there", "workspace": str(tmp_path / "missing")}),
             json.dumps({"prompt": "ok", "workspace": str(tmp_path), "instructions": "be brief"})]
    entries = read_entries(lines)
    assert [e.number for e in entries] == [1, 3, 4, 5, 6, 7]  # the blank line is no turn
    assert entries[0].turn.prompt == "hi" and entries[0].problem is None
    assert entries[1].problem.startswith("line 3: the line: Invalid JSON")
    assert entries[2].problem == "line 4: prompt: Field required" and entries[2].extras == {"promt": "typo"}
    assert entries[3].problem.startswith("line 5: prompt: String should have at least 1 character")
    assert entries[4].problem == f"line 6: workspace {tmp_path / 'missing'} is not a directory"
    assert entries[5].turn.workspace == tmp_path and entries[5].turn.instructions == "be brief"


def test_a_line_may_not_name_a_system_or_shared_folder_as_its_workspace(tmp_path, monkeypatch):
    """A red-team helper's batch line with "/etc" got /etc mounted read-write for its commands."""
    (tmp_path / "project").mkdir()
    (tmp_path / "etc-link").symlink_to("/etc")
    (tmp_path / "linked").symlink_to(tmp_path / "project")
    monkeypatch.chdir(tmp_path)
    refused = ("/etc", "/", "/usr/share", "/tmp", "//etc/.", "/tmp/../etc", "etc-link")
    entries = read_entries([json.dumps({"prompt": "p", "workspace": w}) for w in (*refused, "project", "linked")])
    for entry, shown in zip(entries, ("/etc", "/", "/usr/share", "/tmp", "//etc", "/etc", f"{tmp_path}/etc-link"), strict=False):
        assert entry.problem == (
            f"line {entry.number}: workspace {shown} is a system or shared directory, and the model's commands may "
            "write in their workspace: give a project's folder (--workspace, TOOLQ_WORKSPACE, or Session(workspace=))")
    assert entries[-2].turn.workspace == tmp_path / "project"  # relative: against the current folder
    assert entries[-1].turn.workspace == tmp_path / "linked"  # a link is kept: workers must see the same path


def test_a_line_is_known_by_its_number_and_text():
    assert line_key(3, '{"prompt": "a"}\n') == line_key(3, '{"prompt": "a"}')
    assert line_key(3, '{"prompt": "a"}') != line_key(4, '{"prompt": "a"}')
    assert line_key(3, '{"prompt": "a"}') != line_key(3, '{"prompt": "b"}')


def test_the_latest_result_of_a_key_counts_and_a_cut_line_is_ignored_and_ended(tmp_path):
    out = tmp_path / "results.jsonl"
    first = BatchResult(key="1:a", line=1, status="cancelled")
    out.write_text(first.model_dump_json() + "\n" + '{"key": "2:b", "line": 2, "sta')  # killed mid-write
    assert latest_statuses(out) == {"1:a": "cancelled"}
    results = Results(out)
    results.write(BatchResult(key="1:a", line=1, status="completed"))
    results.close()
    assert latest_statuses(out) == {"1:a": "completed"}
    assert out.read_text().splitlines() == [BatchResult(key="1:a", line=1, status="completed").model_dump_json()]
    assert latest_statuses(tmp_path / "none.jsonl") == {}


def test_bytes_that_are_not_utf8_make_their_line_invalid_and_a_cut_character_is_a_cut_line(tmp_path):
    """A red-team helper's \\xff in an input line, and --out cut inside or after an "é": each made
    every run (and every re-run) a traceback."""
    batch = tmp_path / "batch.jsonl"
    batch.write_bytes(b'{"prompt": "caf\xc3\xa9"}\n{"prompt": "\xff"}\n')
    entries = read_entries(read_lines(batch))
    assert entries[0].turn.prompt == "caf\u00e9" and entries[1].problem == "line 2: not UTF-8 text (at character 13)"
    done = BatchResult(key="1:a", line=1, status="completed", final_message="caf\u00e9").model_dump_json().encode()
    for cut in (done[:-3], done[:done.index(b"\xc3") + 1], done[:done.index(b"\xa9") + 1]):
        out = tmp_path / "out.jsonl"
        out.write_bytes(done + b"\n" + cut)
        assert latest_statuses(out) == {"1:a": "completed"}
        results = Results(out)
        results.write(BatchResult(key="2:b", line=2, status="completed"))  # the cut line is ended, not swallowed
        results.file.seek(0)
        assert results.file.read().startswith(done + b"\n" + cut + b"\n{")
        results.close()  # and at the end the file holds the results alone
        assert [line[:14] for line in out.read_bytes().splitlines()] == [b'{"key":"1:a","', b'{"key":"2:b","']


def test_a_turn_that_never_reached_the_fleet_is_run_again(tmp_path):
    out = tmp_path / "out.jsonl"
    results = Results(out)
    results.write(BatchResult(key="1:a", line=1, status="failed"))
    results.write(BatchResult(key="2:b", line=2, status="failed", error="cannot reach Redis", started=False))
    results.close()
    assert latest_statuses(out) == {"1:a": "failed"}


def test_progress_counts_invalid_lines_apart_and_fits_the_terminal():
    """A new user's 4 invalid lines read "4 failed", and a 93-column line wrapped on an 80-column
    terminal, where a carriage return no longer redraws it in place."""
    import io

    from toolq.cli.batch_progress import Progress

    progress = Progress(total=4, out=io.StringIO())
    for status in ("invalid", "invalid", "failed", "completed"):
        progress.turn_ended(status)
    assert progress.line().startswith("[####################] 4/4 turns, 0 running, 1 failed, 0 cancelled, "
                                      "2 invalid; 0 calls, 0 failed; ")
    assert len(progress.line()) > 80 and not progress.line(80).startswith("[")
    assert progress.line(80).startswith("4/4 turns") and len(progress.line(80)) < 80
    assert progress.line(48).startswith("4/4 turns 0 run 1 fail 0 canc 2 inv ") and len(progress.line(48)) < 48
    assert len(progress.line(20)) == 19


def test_a_line_separator_inside_a_json_string_does_not_split_the_line(tmp_path):
    """A reviewer's final message with U+2028: `splitlines` cut its result in two, and every re-run ran it again."""
    out = tmp_path / "out.jsonl"
    results = Results(out)
    results.write(BatchResult(key="1:a", line=1, status="completed", final_message="a\u2028b\x85c\x0cd"))
    results.close()
    assert latest_statuses(out) == {"1:a": "completed"}
    batch = tmp_path / "batch.jsonl"
    batch.write_text('{"prompt": "one\u2028two"}\r\n{"prompt": "three"}', encoding="utf-8")
    entries = read_entries(read_lines(batch))
    assert [e.turn.prompt for e in entries] == ["one\u2028two", "three"]


def test_unknown_fields_pass_through_and_a_field_named_like_a_result_s_own_is_refused(tmp_path):
    metadata = {"split": "dev", "n": [1, 2.5, None], "deep": {"x": True}}
    entries = read_entries([
        json.dumps({"id": "a", "prompt": "hi", "instance_id": "django-1", "metadata": metadata}),
        json.dumps({"prompt": "hi", "status": "mine", "usage": 3, "id": "b"}),
        json.dumps({"id": "c"}),
    ])
    assert entries[0].turn.prompt == "hi" and entries[0].extras == {"id": "a", "instance_id": "django-1",
                                                                    "metadata": metadata}
    result = BatchResult(key=entries[0].key, line=1, status="completed", **entries[0].extras)
    assert json.loads(result.model_dump_json())["metadata"] == metadata  # untouched, on the way out too
    assert BatchResult.model_validate_json(result.model_dump_json()).model_extra["instance_id"] == "django-1"
    assert entries[1].problem == "line 2: fields status, usage would overwrite toolq's own in the result: rename them"
    assert entries[1].extras == {"id": "b"}  # what does not clash still reaches the invalid result
    assert entries[2].problem == "line 3: prompt: Field required" and entries[2].extras == {"id": "c"}


def test_a_rerun_s_result_replaces_the_key_s_line_atomically_and_never_through_a_link(tmp_path):
    out = tmp_path / "out.jsonl"
    lines = [BatchResult(key=f"{n}:x", line=n, status=s).model_dump_json() for n, s in
             ((2, "cancelled"), (1, "completed"), (2, "completed"), (3, "failed"))]
    out.write_text("\n".join(lines) + "\n" + '{"key": "4:y", "li')  # a line cut by a killed batch
    compact(out)
    assert out.read_text().splitlines() == [lines[1], lines[2], lines[3]]  # line order, the latest of key 2
    before = os.stat(out).st_ino
    compact(out)  # already compact: untouched
    assert os.stat(out).st_ino == before
    target = tmp_path / "target"
    target.write_text("mine\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    with pytest.raises(ConfigurationError, match="is a symbolic link"):
        compact(link)
    replace_durably(link, b"new\n", "--out")  # the link is replaced, not written through
    assert target.read_text() == "mine\n" and link.read_text() == "new\n" and not link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "out.jsonl", "target"]  # no temporary left


def test_results_to_stdout_are_json_lines_and_nothing_is_compacted(tmp_path):
    import io

    stream = io.StringIO()
    results = Results(None, stream=stream)
    results.write(BatchResult(key="1:a", line=1, status="completed", id="x"))
    results.close()
    assert [json.loads(line)["id"] for line in stream.getvalue().splitlines()] == ["x"]


def test_nothing_left_to_run_names_the_failed_lines_and_retry_failed(tmp_path, capsys):
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps({"prompt": f"p{k}"}) + "\n" for k in range(13)))
    entries = read_entries(read_lines(batch))
    out = tmp_path / "out.jsonl"
    out.write_text("".join(BatchResult(key=e.key, line=e.number, status="failed" if e.number > 1 else "completed")
                           .model_dump_json() + "\n" for e in entries))
    workspace = tmp_path / "ws"
    workspace.mkdir()
    settings = Settings(workspace=workspace, redis_url="redis://127.0.0.1:1/0")  # never reached: nothing to run
    assert run_batch(settings, batch, out, concurrency=2, progress_to=__import__("sys").stderr) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"toolq batch: all 13 turns already have a result in {out}; nothing to run; 12 failed (lines 2, 3, 4, 5, 6, "
        "7, 8, 9, 10, 11 and 2 more): --retry-failed runs them again"]


def test_where_names_the_innermost_place_a_task_waits_outside_asyncio():
    async def deepest(never: asyncio.Event) -> None:
        await never.wait()

    async def outer(never: asyncio.Event) -> None:
        await asyncio.create_task(deepest(never))

    async def main() -> str:
        task = asyncio.create_task(outer(asyncio.Event()))
        await asyncio.sleep(0.01)
        said = where(task)
        task.cancel()
        return said

    said = asyncio.run(main())
    assert said.endswith("in test_where_names_the_innermost_place_a_task_waits_outside_asyncio.<locals>.deepest"), said
    assert "test_batch.py:" in said


def test_a_line_whose_extra_field_holds_a_lone_surrogate_is_invalid_not_a_crash():
    """json.loads accepts the escape; no result could carry it back, and writing one raised out of
    the lane and ended the batch with a traceback (found by helper-26)."""
    from toolq.cli.batch import parse_line

    entry = parse_line(1, '{"prompt": "hi", "id": "\\ud800"}')
    assert entry.turn is None and entry.extras == {} and "surrogate" in (entry.problem or "")
    BatchResult(key=entry.key, line=1, status="invalid", error=entry.problem, started=False).model_dump_json()


def test_a_result_that_cannot_be_written_still_lets_its_lane_go(tmp_path):
    """A full disk under --out left the lane marked written but never settled: the batch waited for
    ever, through SIGTERM (found by helper-26)."""
    import io
    from types import SimpleNamespace

    from toolq.cli.batch import Batch, Lane, parse_line
    from toolq.cli.batch_progress import Progress

    class FullDisk(Results):
        def write(self, result: BatchResult) -> None:
            raise OSError(28, "No space left on device")

    async def go() -> tuple[bool, int, str]:
        said = io.StringIO()
        runtime = SimpleNamespace(client=SimpleNamespace(settings=SimpleNamespace(model="m")))
        batch = Batch(runtime, Settings(workspace=tmp_path), FullDisk(None), Progress(total=1, out=io.StringIO()),  # type: ignore[arg-type]
                      concurrency=1, warn=said)
        entry = parse_line(1, '{"prompt": "hi"}')
        assert entry.turn is not None
        lane = Lane(entry=entry, line=entry.turn, turn_id="turn-x")
        batch._write_lane(lane, "completed")
        await asyncio.wait_for(lane.settled, 5)
        return lane.settled.done(), batch.unwritten, said.getvalue()

    settled, unwritten, said = asyncio.run(go())
    assert settled and unwritten == 1 and "No space left on device" in said and "line 1" in said


def test_transcripts_go_only_into_a_folder_no_one_else_may_write(tmp_path):
    from toolq.cli.batch import _refuse_folder_not_mine

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ConfigurationError, match="no one else may write"):
        _refuse_folder_not_mine(shared)
    shared.chmod(0o700)
    _refuse_folder_not_mine(shared)


def test_a_durable_rewrite_is_the_user_s_own(tmp_path):
    path = tmp_path / "results.jsonl"
    replace_durably(path, b"{}\n", "the results")
    assert (path.stat().st_mode & 0o777) == 0o600
