"""The `toolq` command line: every subcommand parses; bad input is one clear line."""

import argparse
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from toolq.cli import main as cli
from toolq.core.settings import Settings


@pytest.mark.parametrize(
    "argv",
    [
        ["decode", "x.sse"],
        ["fake-model", "--port", "0"],
        ["run", "--json", "--model", "m", "--workspace", "/tmp", "--tools", "a", "--tools", "b", "hi"],
        ["run", "-"],
        ["run"],
        ["fake-model", "--loop"],
        ["demo", "--workspace", "/tmp"],
        ["worker", "--queues", "toolq,search", "--concurrency", "2", "--name", "w@h"],
        ["demo", "--json"],
        ["cancel", "turn-1", "--call", "call_1"],
        ["bench", "pipeline", "steps"],
    ],
)
def test_subcommands_parse(argv):
    assert cli.build_parser().parse_args(argv).func is not None


def test_bench_runs_all_by_default_and_refuses_unknown_names(capsys):
    assert cli.build_parser().parse_args(["bench"]).which == []
    assert cli.main(["bench", "nope"]) == 2
    assert "unknown benchmark nope" in capsys.readouterr().err


def test_cancel_without_redis_says_what_to_set(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # no embedded run of ours announced there
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.delenv("CELERY_BROKER_URL", raising=False)
    assert cli.main(["cancel", "turn-1"]) == 2
    assert "set REDIS_URL" in capsys.readouterr().err


def test_a_session_file_round_trips_a_paired_history(tmp_path):
    from toolq.cli.run import load_session, save_session

    path = tmp_path / "s.json"
    assert load_session(path).items == []  # a new file starts a new conversation
    history = load_session(path)
    history.record({"role": "user", "content": "hi"},
                   {"type": "function_call", "name": "f", "arguments": "{}", "call_id": "c"})
    save_session(path, history)  # the call has no output yet: saved paired
    again = load_session(path)
    assert [i["type"] for i in again.to_json()] == ["message", "function_call", "function_call_output"]


def test_a_file_that_is_not_a_session_is_one_clear_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    bad, workspace = tmp_path / "bad.json", tmp_path / "ws"  # the session file outside the workspace
    bad.write_text('{"not": "a list"}')
    workspace.mkdir()
    assert cli.main(["run", "--session", str(bad), "--workspace", str(workspace), "hi"]) == 2
    assert "is not a toolq session" in capsys.readouterr().err


def subcommands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def test_subcommands_are_listed_in_the_order_a_user_needs_them():
    assert list(subcommands()) == ["run", "resume", "batch", "worker", "up", "down", "cancel", "status", "turns",
                                   "workers", "envs", "mcp-server", "exec-server", "queues", "calls", "flower", "config",
                                   "demo", "fake-model", "decode", "bench"]
    listing = cli.build_parser().format_help().split("COMMAND\n")[-1]
    assert re.findall(r"^    (\S+)", listing, re.M) == list(subcommands())


def test_every_argument_and_option_has_help_text():
    missing = [(name, a.dest) for name, parser in subcommands().items() for a in parser._actions
               if not a.help or a.help == argparse.SUPPRESS]
    assert missing == []


def test_version_prints_the_installed_version():
    from importlib import metadata

    out = subprocess.run([sys.executable, "-m", "toolq.cli.main", "--version"], capture_output=True, text=True)
    assert (out.returncode, out.stdout) == (0, f"toolq {metadata.version('toolq')}\n")


class Stdin(io.StringIO):
    def __init__(self, text: str, tty: bool = False) -> None:
        super().__init__(text)
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_the_prompt_comes_from_the_argument_or_from_stdin():
    assert cli.read_prompt("hi", Stdin("ignored")) == "hi"
    assert cli.read_prompt("-", Stdin("from a pipe\nline two\n")) == "from a pipe\nline two"
    assert cli.read_prompt(None, Stdin("piped")) == "piped"
    assert cli.read_prompt("-", Stdin("typed, then ^D", tty=True)) == "typed, then ^D"  # `-` asked for it


@pytest.mark.parametrize("arg, stdin, said", [
    (None, Stdin("", tty=True), "give a PROMPT, or pipe one on stdin (`echo ... | toolq run`)"),
    (None, Stdin(""), "the prompt is empty"),
    ("-", Stdin(" \n\t"), "the prompt is empty"),
    ("  ", Stdin("unused"), "the prompt is empty"),
])
def test_no_prompt_or_an_empty_one_is_refused(arg, stdin, said):
    with pytest.raises(cli.UsageError, match=f"^{said.replace('(', '.').replace(')', '.')}$"):
        cli.read_prompt(arg, stdin)


def test_toolq_run_refuses_an_empty_piped_prompt_in_one_line_before_starting_anything():
    out = subprocess.run([sys.executable, "-m", "toolq.cli.main", "run"], input="\n", capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin", "OPENAI_API_KEY": "sk-x"}, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", "toolq run: the prompt is empty\n")


def test_toolq_run_without_a_key_for_a_remote_url_fails_in_one_line_before_starting_anything(monkeypatch, tmp_path):
    env = {"PATH": "/usr/bin:/bin", "OPENAI_BASE_URL": "https://api.example.com/v1"}
    out = subprocess.run([sys.executable, "-m", "toolq.cli.main", "run", "--workspace", str(tmp_path), "hi"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == ("toolq run: no API key for https://api.example.com/v1: set the OPENAI_API_KEY environment "
                          "variable (only a server on localhost or 127.0.0.1 may be used without one)\n")


def test_demo_refuses_a_workspace_that_is_not_a_directory(tmp_path, capsys):
    assert cli.main(["demo", "--workspace", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == f"toolq: workspace {tmp_path / 'missing'} is not a directory\n"


def test_toolq_run_refuses_a_system_folder_and_makes_a_relative_workspace_absolute(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")  # no key needed: the refusal comes first
    assert cli.main(["run", "--workspace", "/etc", "hi"]) == 2
    assert capsys.readouterr().err == ("toolq: workspace /etc is a system or shared directory, and the model's "
                                       "commands may write in their workspace: give a project's folder (--workspace, TOOLQ_WORKSPACE, or "
                                       "Session(workspace=))\n")
    # Workers resolve a relative path against their own folder (exec_command failed to spawn there).
    monkeypatch.chdir(tmp_path)
    assert Settings(workspace=Path("ws")).workspace == tmp_path / "ws"


def test_workers_and_batch_on_an_unreachable_redis_say_so_in_one_line_and_write_nothing(tmp_path):
    """`toolq workers` printed a traceback; `toolq batch` wrote every line `failed`, so a re-run skipped them."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    env = {"PATH": "/usr/bin:/bin", "REDIS_URL": url, "TOOLQ_SIGNING_KEY": "k" * 32,
           "OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "TOOLQ_WORKSPACE": str(tmp_path / "ws")}  # results outside it
    (tmp_path / "ws").mkdir()
    (tmp_path / "b.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    for argv in (["workers"], ["batch", "b.jsonl", "--out", "r.jsonl"]):
        out = subprocess.run([sys.executable, "-m", "toolq.cli.main", *argv], capture_output=True, text=True,
                             env=env, cwd=tmp_path, timeout=60)
        assert out.returncode == 2, out.stderr
        assert re.fullmatch(rf"toolq: cannot reach Redis at {url}: .*\n", out.stderr), out.stderr
    assert not (tmp_path / "r.jsonl").exists() or not (tmp_path / "r.jsonl").read_text()


def test_a_wrong_redis_password_is_told_as_wrong_credentials_not_as_an_unreachable_server(tmp_path):
    """It answered: `cannot reach` sent a newcomer to check the network, not the password."""
    from toolq.local.embedded import RedisServer

    with RedisServer() as server:
        url = server.url.replace(server.url.split("@")[0].split("//")[1], ":not-the-password")
        env = {"PATH": "/usr/bin:/bin", "REDIS_URL": url, "TOOLQ_SIGNING_KEY": "k" * 32}
        out = subprocess.run([sys.executable, "-m", "toolq.cli.main", "workers"], capture_output=True, text=True,
                             env=env, cwd=tmp_path, timeout=60)
    assert out.returncode == 2, out.stderr
    assert re.fullmatch(r"toolq: Redis at redis://:\*\*\*\*@127.0.0.1:[0-9]+/0 refused the credentials: .* "
                        r"\(check REDIS_URL's user and password\)\n", out.stderr), out.stderr
    assert "not-the-password" not in out.stderr


def test_the_live_view_shows_the_final_error_once():
    from pydantic import TypeAdapter

    from toolq.cli.view import LiveView
    from toolq.orchestrator.turn_events import TurnEvent

    out = io.StringIO()
    live, as_event = LiveView(out), TypeAdapter(TurnEvent).validate_python

    def view(event: dict) -> None:
        live(as_event(event))

    final = "401 Unauthorized from http://127.0.0.1:1/v1/responses: bad key; set OPENAI_API_KEY to a valid key"
    for event in [{"type": "turn.started", "turn_id": "turn-1"},
                  {"type": "error", "message": "Reconnecting... 1/5 (cannot reach ...)"},
                  {"type": "error", "message": final},
                  {"type": "turn.failed", "turn_id": "turn-1", "error": {"message": final}}]:
        view(event)
    assert out.getvalue().splitlines() == ["toolq turn turn-1", "  ! Reconnecting... 1/5 (cannot reach ...)",
                                           f"  ! {final}", "turn failed"]
    view({"type": "turn.failed", "turn_id": "turn-1", "error": {"message": "turn stopped after 100 responses"}})
    assert out.getvalue().splitlines()[-1] == "turn failed: turn stopped after 100 responses"


def test_a_redis_that_refuses_the_database_is_one_line_exit_2(tmp_path):
    """A red-team helper's REDIS_URL=.../99: `DB index is out of range` was a traceback."""
    from toolq.local.embedded import RedisServer

    (tmp_path / "b.jsonl").write_text('{"prompt": "a"}\n')
    with RedisServer() as server:
        env = {"PATH": "/usr/bin:/bin", "REDIS_URL": server.url.rsplit("/", 1)[0] + "/99",
               "TOOLQ_SIGNING_KEY": "k" * 32, "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
               "TOOLQ_WORKSPACE": str(tmp_path / "ws")}  # the results outside the workspace
        (tmp_path / "ws").mkdir()
        for argv in (["workers"], ["batch", "b.jsonl", "--out", "r.jsonl"], ["status", "turn-x"]):
            out = subprocess.run([sys.executable, "-m", "toolq.cli.main", *argv], capture_output=True,
                                 text=True, env=env, cwd=tmp_path, timeout=60)
            assert (out.returncode, out.stderr.splitlines()[-1:]) == (2, [
                "toolq: Redis refused: DB index is out of range (check REDIS_URL: its database number, user and "
                "password)"]), out.stderr
