"""`toolq flower`: loopback by default, basic auth from the environment, no open API unless asked."""

from __future__ import annotations

import subprocess

import pytest

from toolq.cli import main as cli
from toolq.cli.flower import flower_launch, is_loopback
from toolq.core.errors import ConfigurationError
from toolq.core.settings import Settings

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
