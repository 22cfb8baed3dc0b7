"""exec_command: Codex's output text, truncation, limits and confinement (reference §5 rules 7, 8, 14)."""

from __future__ import annotations

import json
import re
import threading
import time

import psutil
import pytest

from tests import markers
from tests.unit.tools import call
from toolq.core.catalog import ToolReturn
from toolq.core.errors import RespondToModel
from toolq.workers.processes import CallCancelled
from toolq.workers.tools.exec_command import ExecCommandArgs, exec_command

HEADER = re.compile(
    r"Chunk ID: [0-9a-f]{6}\nWall time: \d+\.\d{4} seconds\nProcess exited with code (-?\d+)\n"
    r"Original token count: (\d+)\nOutput:\n"
)


def run(tmp_path, **arguments) -> ToolReturn:
    return call(exec_command, tmp_path, json.dumps(arguments))


def split(result: ToolReturn) -> tuple[int, int, str]:
    m = HEADER.match(result.output)
    assert m, result.output[:300]
    return int(m.group(1)), int(m.group(2)), result.output[m.end() :]


def seq_output(n: int) -> str:
    return "".join(f"{i}\n" for i in range(1, n + 1))


def test_output_text_has_codex_layout(tmp_path):
    r = run(tmp_path, cmd="echo one")
    assert HEADER.match(r.output)
    assert r.output.endswith("\nProcess exited with code 0\nOriginal token count: 1\nOutput:\none\n")
    assert (r.success, r.exit_code) == (True, 0)


def test_nonzero_exit_is_a_normal_output_with_stderr_interleaved(tmp_path):
    r = run(tmp_path, cmd="echo a; echo b >&2; echo c; exit 3")
    assert split(r) == (3, 2, "a\nb\nc\n")
    assert (r.success, r.exit_code) == (False, 3)


def test_truncation_matches_codex_figures_for_seq_30000(tmp_path):
    full = seq_output(30000)
    exit_code, tokens, body = split(run(tmp_path, cmd="seq 1 30000"))
    assert (exit_code, tokens) == (0, 42224)
    assert body == (
        "Warning: truncated output (original token count: 42224)\nTotal output lines: 30000\n\n"
        + full[:20000]
        + "…32224 tokens truncated…"
        + full[-20000:]
    )


def test_max_output_tokens_sets_the_budget(tmp_path):
    full = seq_output(30000)
    _, tokens, body = split(run(tmp_path, cmd="seq 1 30000", max_output_tokens=100))
    assert tokens == 42224
    assert body.endswith("\n\n" + full[:200] + "…42124 tokens truncated…" + full[-200:])


def test_max_output_tokens_is_clamped_to_the_policy(tmp_path):
    _, _, body = split(run(tmp_path, cmd="seq 1 30000", max_output_tokens=50000))
    assert "…32224 tokens truncated…" in body


def test_output_at_the_budget_is_not_truncated(tmp_path):
    _, tokens, body = split(run(tmp_path, cmd="head -c 400 /dev/zero | tr '\\0' x", max_output_tokens=100))
    assert (tokens, body) == (100, "x" * 400)


def test_workdir_is_resolved_inside_the_workspace(tmp_path):
    (tmp_path / "sub").mkdir()
    _, _, body = split(run(tmp_path, cmd="pwd", workdir="sub"))
    assert body == f"{(tmp_path / 'sub').resolve()}\n"
    _, _, body = split(run(tmp_path, cmd="pwd"))
    assert body == f"{tmp_path}\n"


@pytest.mark.parametrize("workdir", ["..", "/tmp", "link"])
def test_workdir_escaping_the_workspace_is_refused(tmp_path, workdir):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "link").symlink_to(tmp_path)
    with pytest.raises(RespondToModel, match=re.escape(f"`{workdir}`")):
        run(ws, cmd="touch escaped", workdir=workdir)
    assert not (tmp_path / "escaped").exists()


def test_missing_workdir_gives_codex_spawn_failure_text(tmp_path):
    with pytest.raises(RespondToModel) as e:
        run(tmp_path, cmd="echo hi", workdir="does/not/exist")
    assert e.value.message == (
        'exec_command failed: CreateProcess { message: "Rejected(\\"Failed to create unified exec process: '
        'No such file or directory (os error 2)\\")" }'
    )


def test_timeout_kills_the_group_and_reports_exit_124(tmp_path):
    # A marker, not a pid: inside the sandbox's pid namespace `$!` is not the host's pid.
    marker = f"30.{markers.PROCESS}7"
    started = time.monotonic()
    r = run_with_deadline(tmp_path, f"sleep {marker} & echo started; sleep 30", deadline_in=0.5)
    assert time.monotonic() - started < 10
    exit_code, _, body = split(r)
    assert (exit_code, r.exit_code, r.success) == (124, 124, False)
    m = re.fullmatch(r"command timed out after (\d+) milliseconds\nstarted\n", body)
    assert m and 0 < int(m.group(1)) <= 500
    deadline = time.monotonic() + 5
    while _running(f"sleep {marker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(f"sleep {marker}")


def run_with_deadline(tmp_path, cmd: str, deadline_in: float) -> ToolReturn:
    return call(exec_command, tmp_path, json.dumps({"cmd": cmd}), deadline_in=deadline_in)


def _running(cmdline: str) -> bool:
    for p in psutil.process_iter(["cmdline", "status"]):
        if " ".join(p.info["cmdline"] or []) == cmdline and p.info["status"] != psutil.STATUS_ZOMBIE:
            return True
    return False


def test_cancellation_kills_the_command_and_raises_call_cancelled(tmp_path):
    flag = threading.Event()
    threading.Timer(0.3, flag.set).start()
    started = time.monotonic()
    with pytest.raises(CallCancelled):
        call(exec_command, tmp_path, json.dumps({"cmd": "sleep 30"}), is_cancelled=flag.is_set)
    assert time.monotonic() - started < 10


def test_yield_time_ms_is_clamped_and_never_yields_early(tmp_path):
    assert ExecCommandArgs(cmd="x", yield_time_ms=1).yield_time_ms == 250
    assert ExecCommandArgs(cmd="x", yield_time_ms=10**6).yield_time_ms == 30_000
    exit_code, _, body = split(run(tmp_path, cmd="sleep 0.6; echo done", yield_time_ms=250))
    assert (exit_code, body) == (0, "done\n")


def test_given_shell_runs_the_command(tmp_path):
    _, _, body = split(run(tmp_path, cmd='echo "$0"', shell="sh"))
    assert body == "sh\n"


def test_unknown_shell_is_a_spawn_failure(tmp_path):
    with pytest.raises(RespondToModel, match=r"Failed to create unified exec process: No such file"):
        run(tmp_path, cmd="true", shell="/no/such/shell")


def test_missing_cmd_is_a_parse_error(tmp_path):
    with pytest.raises(RespondToModel, match="^failed to parse function arguments: missing field `cmd`$"):
        call(exec_command, tmp_path, json.dumps({"command": ["echo", "x"]}))


def test_negative_max_output_tokens_is_a_parse_error(tmp_path):
    with pytest.raises(RespondToModel, match="max_output_tokens"):
        run(tmp_path, cmd="true", max_output_tokens=-1)


def test_codex_only_fields_are_accepted_and_ignored(tmp_path):
    r = run(tmp_path, cmd="echo ok", tty=True, login=True, justification="why", sandbox_permissions="use_default")
    assert split(r) == (0, 1, "ok\n")


def test_spec_declares_codex_schema_and_flags():
    spec = exec_command.tool_spec
    assert (spec.name, spec.kind, spec.strict, spec.parallel, spec.shell_like) == (
        "exec_command", "function", False, True, True,
    )
    params = spec.model_spec()["parameters"]
    assert params["required"] == ["cmd"] and params["additionalProperties"] is False
    assert {k: v["type"] for k, v in params["properties"].items()} == {
        "cmd": "string", "workdir": "string", "yield_time_ms": "number", "max_output_tokens": "number",
        "tty": "boolean", "shell": "string", "login": "boolean", "justification": "string",
    }
    assert "keeps running as a session" in spec.description and "write_stdin" in spec.description
