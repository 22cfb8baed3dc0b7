"""`toolq flower`: loopback by default, basic auth from the environment, no open API unless asked; and
what Flower's args column shows of a call (`toolq.core.flower_args`, rendered by both ends)."""

from __future__ import annotations

import json
import subprocess

import pytest

from toolq.cli import main as cli
from toolq.cli.flower import flower_launch, is_loopback
from toolq.core.catalog import ToolSpec
from toolq.core.errors import ConfigurationError
from toolq.core.flower_args import FLOWER_ARGS_CHARS, flower_args, secret_name
from toolq.core.mcp_specs import McpToolRecord, tool_spec
from toolq.core.settings import Settings
from toolq.workers.loader import load_catalog

URL = "redis://127.0.0.1:6390/0"


def settings(**kw) -> Settings:
    return Settings(redis_url=URL, **kw)


@pytest.fixture
def no_subprocess(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("Flower must not be started")

    monkeypatch.setattr(subprocess, "Popen", refuse)


def test_toolq_flower_refuses_to_start_without_auth(monkeypatch, capsys, no_subprocess):
    monkeypatch.setenv("REDIS_URL", URL)
    for var in ("FLOWER_USER", "FLOWER_PASSWORD"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLOWER_UNAUTHENTICATED_API", "true")  # left in the shell: does not count
    assert cli.main(["flower"]) == 2
    err = capsys.readouterr().err
    assert "refusing to start Flower without authentication" in err
    assert "FLOWER_USER and FLOWER_PASSWORD" in err and "--unauthenticated-api" in err


def test_toolq_flower_needs_a_broker(monkeypatch, capsys, no_subprocess):
    for var in ("REDIS_URL", "CELERY_BROKER_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLOWER_USER", "ops")
    monkeypatch.setenv("FLOWER_PASSWORD", "pw")
    assert cli.main(["flower"]) == 2
    assert "REDIS_URL" in capsys.readouterr().err


def test_credentials_go_to_flower_through_the_environment_not_argv():
    launch = flower_launch(settings(flower_user="ops", flower_password="s3cret"),
                           base_env={"CELERY_BROKER_URL": "redis://elsewhere/0", "FLOWER_BASIC_AUTH": "old:pw",
                                     "FLOWER_UNAUTHENTICATED_API": "true", "PATH": "/bin"})
    assert launch.argv[1:] == ["-P", "-m", "celery", "--app", "toolq.workers.app", "flower", "--address=127.0.0.1",
                               "--port=5555"]  # -P: nothing imported from where it starts (issue 24)
    assert not any("s3cret" in a for a in launch.argv)
    assert launch.env["FLOWER_BASIC_AUTH"] == "ops:s3cret"
    assert launch.env["REDIS_URL"] == URL and "CELERY_BROKER_URL" not in launch.env
    assert "FLOWER_UNAUTHENTICATED_API" not in launch.env and launch.env["PATH"] == "/bin"
    assert launch.warnings == [] and launch.url == "http://127.0.0.1:5555"
    assert "s3cret" not in repr(launch)


def test_port_and_address_come_from_settings_unless_given():
    s = settings(flower_user="ops", flower_password="pw", flower_port=6000, flower_address="::1")
    assert flower_launch(s, base_env={}).url == "http://[::1]:6000"
    assert flower_launch(s, port=7000, address="127.0.0.2", base_env={}).argv[-2:] == ["--address=127.0.0.2",
                                                                                     "--port=7000"]


def test_unauthenticated_api_is_opened_only_when_asked_and_only_on_loopback():
    launch = flower_launch(settings(), unauthenticated_api=True, base_env={})
    assert launch.env["FLOWER_UNAUTHENTICATED_API"] == "true" and "FLOWER_BASIC_AUTH" not in launch.env
    assert "no authentication" in launch.warnings[0]
    with pytest.raises(ConfigurationError, match="only allowed on a loopback address"):
        flower_launch(settings(), unauthenticated_api=True, address="0.0.0.0", base_env={})


def test_credentials_win_over_unauthenticated_api():
    launch = flower_launch(settings(flower_user="ops", flower_password="pw"), unauthenticated_api=True, base_env={})
    assert "FLOWER_UNAUTHENTICATED_API" not in launch.env and launch.env["FLOWER_BASIC_AUTH"] == "ops:pw"
    assert "ignored" in launch.warnings[0]


def test_a_public_address_is_allowed_with_auth_but_warned_about():
    launch = flower_launch(settings(flower_user="ops", flower_password="pw"), address="0.0.0.0", base_env={})
    assert "/metrics" in launch.warnings[0] and "0.0.0.0" in launch.warnings[0]


@pytest.mark.parametrize("user,password,message", [
    ("ops", None, "set both FLOWER_USER and FLOWER_PASSWORD"),
    (None, "pw", "set both FLOWER_USER and FLOWER_PASSWORD"),
    ("o:ps", "pw", "may not contain"),
    ("ops", "p,w", "may not contain"),
])
def test_credentials_flower_cannot_use_are_refused(user, password, message):
    with pytest.raises(ConfigurationError, match=message):
        flower_launch(settings(flower_user=user, flower_password=password), base_env={})


@pytest.mark.parametrize("address,expected", [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("", False), ("10.0.0.5", False), ("example.org", False),
])
def test_is_loopback(address, expected):
    assert is_loopback(address) is expected


# --- what Flower's args column shows (issue 26 item 1): the worker renders it from its declaration

BASE = "call_id='call_1', turn='turn-1'"


def invocation(arguments: object = None, *, kind: str = "function", **payload: object) -> dict:
    if kind == "function":
        payload = {"arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}
    return {"call_id": "call_1", "turn_id": "turn-1", "tool_name": {"name": "t"}, "payload": {"kind": kind, **payload}}


def function_spec(properties: dict | None = None, **kw) -> ToolSpec:
    schema = {"type": "object", **({"properties": properties} if properties is not None else {})}
    return ToolSpec(name="t", parameters=schema, **kw)


@pytest.mark.parametrize("name", ["password", "db_password", "api_key", "apiKey", "accessToken", "X-Auth-Token",
                                  "client_secret", "PRIVATE_KEY", "passphrase", "cookie", "Authorization", "otp"])
def test_names_that_look_secret(name):
    assert secret_name(name)


@pytest.mark.parametrize("name", ["query", "keyword", "author", "max_tokens", "file_path", "session_id", "monkey",
                                  "passage", "cmd", "compass", "tokenizer_name"])
def test_names_that_do_not(name):
    assert not secret_name(name)


def test_a_tool_with_no_declaration_shows_each_argument_its_schema_names_in_order_and_secrets_by_length():
    spec = function_spec({"host": {"type": "string"}, "password": {"type": "string"}, "port": {"type": "integer"},
                          "apiToken": {"type": "string"}, "opts": {"type": "object"}})
    shown = flower_args(invocation({"port": 5432, "password": "hunter2!", "host": "db1", "apiToken": "sk-abc",
                                    "opts": {"a": [1]}, "unnamed": "not in the schema"}), spec)
    assert shown == f"({BASE}, host='db1', password=8, port=5432, apiToken=6, opts={{'a': [1]}})"
    assert "hunter2" not in shown and "sk-abc" not in shown and "unnamed" not in shown


def test_a_declaration_says_what_is_shown_and_a_secret_name_is_shown_by_length_even_when_declared():
    spec = function_spec({"url": {"type": "string"}, "token": {"type": "string"}, "body": {"type": "string"}},
                         flower_args=(("url", "value"), ("token", "value")))
    assert flower_args(invocation({"url": "https://x", "token": "t0ps3cret", "body": "b"}), spec) == \
        f"({BASE}, url='https://x', token=9)"


def test_every_shown_value_shares_one_budget_however_many_and_whatever_the_model_sends():
    spec = function_spec({f"a{i}": {} for i in range(50)})
    hostile = {f"a{i}": v for i, v in enumerate(["x" * 100_000, list(range(100_000)), {"k": "v" * 100_000}] * 16)}
    shown = flower_args(invocation(hostile), spec)
    assert len(shown) <= len(f"({BASE})") + FLOWER_ARGS_CHARS + 10 * len(", a00=''"), len(shown)
    # A schema that names nothing (an MCP server's bare object): the model's keys, names counted too.
    free = flower_args(invocation({("k" * 1000) + str(i): "v" * 1000 for i in range(500)}), function_spec())
    assert len(free) <= len(f"({BASE})") + FLOWER_ARGS_CHARS + 10 * len(", =''")


def test_a_schema_that_names_nothing_shows_the_models_top_level_keys_but_no_secret():
    shown = flower_args(invocation({"path": "/srv/a", "secret_key": "abc123"}), function_spec())
    assert shown == f"({BASE}, path='/srv/a', secret_key=6)"


def test_an_mcp_tools_arguments_come_from_its_listed_schema():
    record = McpToolRecord(server="db", name="query", timeout=30,
                           input_schema={"type": "object", "properties": {"sql": {"type": "string"},
                                                                          "password": {"type": "string"}}})
    shown = flower_args(invocation({"sql": "select 1", "password": "pw"}), tool_spec(record))
    assert shown == f"({BASE}, sql='select 1', password=2)"


def test_the_built_ins_each_show_their_arguments_in_short():
    builtins = {s.name: s for s in load_catalog([])}
    assert flower_args(invocation({"file_path": "a.txt", "offset": None, "limit": 20}), builtins["read_file"]) == \
        f"({BASE}, file_path='a.txt', limit=20)"
    assert flower_args(invocation({"pattern": "fo+", "path": "src", "include": None, "limit": None}),
                       builtins["grep_files"]) == f"({BASE}, pattern='fo+', path='src')"
    assert flower_args(invocation(kind="custom", input="*** Begin Patch\n"), builtins["apply_patch"]) == \
        f"({BASE}, input='*** Begin Patch\\n')"
    assert flower_args(invocation({"cmd": "make test", "workdir": "/w"}), builtins["exec_command"]) == \
        f"({BASE}, cmd='make test')"  # declared: the command alone
    assert flower_args(invocation({"session_id": 3, "chars": "hunter2\n"}), builtins["write_stdin"]) == \
        f"({BASE}, session_id=3, chars=8)"


@pytest.mark.parametrize("raw", [None, 42, {"payload": "nope"}, invocation("{not json"), invocation("[1, 2]"),
                                 invocation("[" * 10_000)])
def test_what_no_toolq_orchestrator_sent_shows_the_call_alone_and_never_raises(raw):
    shown = flower_args(raw, function_spec({"a": {}}))
    assert shown in ("()", f"({BASE})", "(call_id='None', turn='None')")
