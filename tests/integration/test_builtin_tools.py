"""The built-in tools end to end: fake model -> orchestrator -> Redis -> prefork workers and back.

Where Codex fixes a text (docs/reference/codex-behaviour.md) it is checked byte for
byte; each tool's bad inputs and limits come back as outputs the model can read.
"""

from __future__ import annotations

import base64
import re
import struct
import zlib

import pytest

import tests.integration.deferred_tools as deferred_tools
from tests.integration.conftest import TEST_TOOLS, WORKER_ENV
from toolq.dev.fake_model import builders as b
from toolq.local.embedded import RedisServer, WorkerProcess

pytestmark = pytest.mark.integration

# Codex's exec_command text (docs/reference/codex-behaviour.md#exec_command).
EXEC_OUTPUT = re.compile(
    r"Chunk ID: [0-9a-f]{6}\nWall time: \d+\.\d{4} seconds\nProcess exited with code (-?\d+)\n"
    r"Original token count: (\d+)\nOutput:\n(.*)",
    re.DOTALL,
)


def final(text="done"):
    return [b.message(text)]


def outputs(run, k=1) -> dict[str, str]:
    return {o["call_id"]: o["output"] for o in run.outputs_of(k) if "output" in o}  # tool_search_output has none


def completed_items(run) -> dict[str, dict]:
    return {e["item"]["id"]: e["item"] for e in run.events if e["type"] == "item.completed"}


def exec_parts(text: str) -> tuple[int, int, str]:
    m = EXEC_OUTPUT.fullmatch(text)
    assert m, f"not Codex's exec_command format:\n{text!r}"
    return int(m[1]), int(m[2]), m[3]


# --- exec_command ------------------------------------------------------------------------------


def test_exec_command_output_is_codex_text_for_parallel_calls(fleet, drive):
    run = drive([
        [b.function_call("exec_command", {"cmd": "echo one"}, "call_one"),
         b.function_call("exec_command", {"cmd": "echo two"}, "call_two")],
        final(),
    ])
    out = outputs(run)
    assert exec_parts(out["call_one"]) == (0, 1, "one\n")
    assert exec_parts(out["call_two"]) == (0, 1, "two\n")
    items = completed_items(run)
    assert (items["call_one"]["exit_code"], items["call_one"]["success"]) == (0, True)


def test_exec_command_nonzero_exit_is_a_normal_output_with_stderr_merged(fleet, drive):
    run = drive([[b.function_call("exec_command", {"cmd": "echo out; echo err >&2; exit 3"}, "call_fail")],
                 final()])
    assert run.outcome.status == "completed"
    assert exec_parts(outputs(run)["call_fail"]) == (3, 2, "out\nerr\n")
    item = completed_items(run)["call_fail"]
    assert (item["exit_code"], item["success"]) == (3, False)


def test_exec_command_truncates_to_max_output_tokens_like_codex(fleet, drive):
    full = "".join(f"{i}\n" for i in range(1, 3001))
    run = drive([[b.function_call("exec_command", {"cmd": "seq 1 3000", "max_output_tokens": 100}, "call_seq")],
                 final()])
    # Codex kept 200 + 200 bytes and said `…3374 tokens truncated…` for this budget
    assert exec_parts(outputs(run)["call_seq"]) == (0, 3474, (
        "Warning: truncated output (original token count: 3474)\nTotal output lines: 3000\n\n"
        + full[:200] + "…3374 tokens truncated…" + full[-200:]))


def test_exec_command_bad_inputs_are_outputs_and_the_turn_goes_on(fleet, drive):
    run = drive([
        [b.function_call("exec_command", {"cmd": "true", "workdir": "missing"}, "call_workdir"),
         b.function_call("exec_command", {"command": ["echo", "x"]}, "call_shape"),
         b.function_call("exec_command", {"cmd": "pwd", "workdir": "../"}, "call_escape")],
        final(),
    ])
    assert run.outcome.status == "completed"
    out = outputs(run)
    assert out["call_workdir"] == ('exec_command failed: CreateProcess { message: "Rejected(\\"Failed to create '
                                   'unified exec process: No such file or directory (os error 2)\\")" }')
    assert out["call_shape"].startswith("failed to parse function arguments: missing field `cmd`")
    assert out["call_escape"] == "path `../` is not allowed: `..` components may not be used"


# --- apply_patch -------------------------------------------------------------------------------

ADD_HELLO = "*** Begin Patch\n*** Add File: hello.txt\n+hello\n*** End Patch\n"
UPDATE_HELLO = "*** Begin Patch\n*** Update File: hello.txt\n@@\n-hello\n+hello, world\n*** End Patch\n"


def test_apply_patch_custom_call_adds_then_updates_a_file_with_codex_text(fleet, drive, tmp_path):
    run = drive([
        [b.custom_tool_call("apply_patch", ADD_HELLO, "call_add")],
        [b.custom_tool_call("apply_patch", UPDATE_HELLO, "call_update")],
        final(),
    ])
    added, updated = run.outputs_of(1)[-1], run.outputs_of(2)[-1]
    assert (added["type"], added["call_id"]) == ("custom_tool_call_output", "call_add")
    assert added["output"] == ("Exit code: 0\nWall time: 0 seconds\nOutput:\nSuccess. Updated the following "
                               "files:\nA hello.txt\n")
    assert updated["output"] == ("Exit code: 0\nWall time: 0 seconds\nOutput:\nSuccess. Updated the following "
                                 "files:\nM hello.txt\n")
    assert (tmp_path / "hello.txt").read_text() == "hello, world\n"


def test_apply_patch_verification_failures_use_codex_text_and_write_nothing(fleet, drive, tmp_path):
    run = drive([
        [b.custom_tool_call("apply_patch", "Add File: x.txt\n+x\n", "call_invalid"),
         b.custom_tool_call("apply_patch", "*** Begin Patch\n*** Add File: partial.txt\n+x\n"
                                           "*** Update File: nope.txt\n@@\n-a\n+b\n*** End Patch\n", "call_missing")],
        final(),
    ])
    assert run.outcome.status == "completed"
    out = outputs(run)
    assert out["call_invalid"] == ("apply_patch verification failed: invalid patch: The first line of the patch "
                                   "must be '*** Begin Patch'")
    assert out["call_missing"] == ("apply_patch verification failed: Failed to read file to update "
                                   f"{tmp_path.resolve()}/nope.txt: No such file or directory (os error 2)")
    assert not (tmp_path / "partial.txt").exists(), "a patch that failed verification wrote a file"


def test_apply_patch_as_a_function_call_fails_the_turn_with_paired_history(fleet, drive, tmp_path):
    run = drive([[b.function_call("apply_patch", {"input": ADD_HELLO}, "call_fn")], final()])
    assert run.outcome.status == "failed"
    assert run.outcome.error == "Fatal error: tool apply_patch invoked with incompatible payload"
    assert len(run.requests) == 1
    history = run.session.history.for_prompt()
    assert [(i["type"], i.get("output")) for i in history if i.get("call_id") == "call_fn"] == [
        ("function_call", None), ("function_call_output", "aborted")]
    assert not (tmp_path / "hello.txt").exists()


# --- update_plan, view_image ---------------------------------------------------------------------


def test_update_plan_acknowledges_and_rejects_an_unknown_status(fleet, drive):
    plan = [{"step": "read the code", "status": "completed"}, {"step": "write tests", "status": "in_progress"}]
    run = drive([
        [b.function_call("update_plan", {"explanation": None, "plan": plan}, "call_plan"),
         b.function_call("update_plan", {"plan": [{"step": "x", "status": "done"}]}, "call_bad")],
        final(),
    ])
    out = outputs(run)
    assert out["call_plan"] == "Plan updated"
    assert out["call_bad"].startswith("failed to parse function arguments: invalid value at `plan.0.status`: ")


def png_1x1() -> bytes:
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))


def test_view_image_answers_with_an_input_image_content_list(fleet, drive, tmp_path):
    (tmp_path / "dot.png").write_bytes(png_1x1())
    (tmp_path / "fake.png").write_text("not an image")
    run = drive([
        [b.function_call("view_image", {"path": "dot.png"}, "call_img"),
         b.function_call("view_image", {"path": "absent.png"}, "call_absent"),
         b.function_call("view_image", {"path": "fake.png"}, "call_fake")],
        final(),
    ])
    out = outputs(run)
    data_url = "data:image/png;base64," + base64.b64encode(png_1x1()).decode()
    assert out["call_img"] == [{"type": "input_image", "image_url": data_url, "detail": "high"}]
    root = tmp_path.resolve()
    assert out["call_absent"] == f"unable to locate image at `{root}/absent.png`: No such file or directory (os error 2)"
    assert out["call_fake"] == f"`{root}/fake.png` is not a supported image (png, jpeg, gif or webp)"


# --- read_file, list_dir, grep_files -------------------------------------------------------------


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "notes.txt").write_text("alpha\nbeta\ngamma\n")
    (tmp_path / "sub" / "inner.txt").write_text("needle\n")
    (tmp_path / "out").symlink_to("/etc")
    return tmp_path.resolve()


def test_read_file_reads_numbered_lines_and_refuses_paths_outside_the_workspace(fleet, drive, tree):
    run = drive([
        [b.function_call("read_file", {"file_path": "notes.txt", "offset": 2, "limit": None}, "call_read"),
         b.function_call("read_file", {"file_path": "../notes.txt"}, "call_dots"),
         b.function_call("read_file", {"file_path": "/etc/hostname"}, "call_abs"),
         b.function_call("read_file", {"file_path": "out/hostname"}, "call_link"),
         b.function_call("read_file", {"file_path": "notes.txt", "limit": 0}, "call_limit"),
         b.function_call("read_file", {"file_path": "notes.txt", "offset": 9}, "call_offset")],
        final(),
    ], workspace=tree)
    out = outputs(run)
    assert out["call_read"] == "L2: beta\nL3: gamma"
    assert out["call_dots"] == "path `../notes.txt` is not allowed: `..` components may not be used"
    assert out["call_abs"] == f"path `/etc/hostname` is outside the workspace `{tree}`"
    assert out["call_link"] == f"path `out/hostname` leads outside the workspace `{tree}` through a symlink"
    assert out["call_limit"] == "limit must be greater than zero"
    assert out["call_offset"] == "offset exceeds file length"


def test_list_dir_lists_the_tree_and_refuses_paths_outside_the_workspace(fleet, drive, tree):
    run = drive([
        [b.function_call("list_dir", {"dir_path": "."}, "call_list"),
         b.function_call("list_dir", {"dir_path": "/"}, "call_root"),
         b.function_call("list_dir", {"dir_path": "sub/../.."}, "call_dots"),
         b.function_call("list_dir", {"dir_path": "out"}, "call_link"),
         b.function_call("list_dir", {"dir_path": ".", "depth": 0}, "call_depth")],
        final(),
    ], workspace=tree)
    out = outputs(run)
    assert out["call_list"] == f"Absolute path: {tree}\nnotes.txt\nout@\nsub/\n  inner.txt"
    assert out["call_root"] == f"path `/` is outside the workspace `{tree}`"
    assert out["call_dots"] == "path `sub/../..` is not allowed: `..` components may not be used"
    assert out["call_link"] == f"path `out` leads outside the workspace `{tree}` through a symlink"
    assert out["call_depth"] == "depth must be greater than zero"


def test_grep_files_lists_matching_paths_or_says_none_matched(fleet, drive, tree):
    run = drive([
        [b.function_call("grep_files", {"pattern": "ne+dle"}, "call_hit"),
         b.function_call("grep_files", {"pattern": "absent-word"}, "call_miss"),
         b.function_call("grep_files", {"pattern": "("}, "call_bad")],
        final(),
    ], workspace=tree)
    out = outputs(run)
    assert out["call_hit"] == f"{tree}/sub/inner.txt"
    assert out["call_miss"] == "No matches found."
    assert out["call_bad"] == "invalid regex `(`: missing ): ("


# --- tool_search over deferred tools -------------------------------------------------------------


@pytest.fixture
def deferred_stack(tmp_path):
    """A broker of our own whose worker loads the deferred tools too: tool_search runs on a worker and
    searches that worker's catalog, which the shared fleet's does not include."""
    with RedisServer() as server, WorkerProcess(server.url, name="deferred@test", queues=["toolq"], concurrency=2,
                                                tools=[TEST_TOOLS, "tests.integration.deferred_tools"],
                                                env=WORKER_ENV, logdir=tmp_path):
        yield server


def names(tools: list[dict]) -> set[str]:
    found = set()
    for t in tools:
        if t.get("type") == "namespace":
            found |= {f"{t['name']}.{sub['name']}" for sub in t["tools"]}
        elif "name" in t:
            found.add(t["name"])
    return found


def test_tool_search_loads_a_deferred_tool_that_the_next_response_calls(deferred_stack, drive):
    convert = deferred_tools.convert_currency.tool_spec.model_spec()
    run = drive([
        [b.tool_search_call({"query": "currency exchange rate", "limit": 3}, "call_search")],
        [b.function_call("convert_currency", {"amount": 8, "currency": "USD"}, "call_convert")],
        final(),
    ], redis_url=deferred_stack.url, tools=[TEST_TOOLS, "tests.integration.deferred_tools"])
    assert run.outcome.status == "completed"
    first, second = run.requests[0]["tools"], run.requests[1]["tools"]
    assert "tool_search" in {t["type"] for t in first}
    assert not names(first) & {"convert_currency", "calendar.create_event"}, "a deferred tool was offered up front"

    found = [i for i in run.input_of(1) if i["type"] == "tool_search_output"]
    assert len(found) == 1
    assert (found[0]["call_id"], found[0]["execution"], found[0]["tools"]) == ("call_search", "client", [convert])

    assert convert in second
    assert "calendar.create_event" not in names(second), "a tool the search did not find was loaded"
    assert outputs(run, 2)["call_convert"] == "8 EUR = 10 USD"
    assert completed_items(run)["call_convert"]["worker"] == "deferred@test"
