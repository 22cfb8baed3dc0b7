"""The one settings model: environment, CLI overrides, masking, and one clear line per bad value."""

from __future__ import annotations

import json

import pytest

from toolq.cli import main as cli
from toolq.core.errors import ConfigurationError
from toolq.core.settings import ENV, Settings, mask_url_password


def test_every_setting_can_be_set_from_the_environment():
    assert set(ENV) == set(Settings.model_fields)


def test_no_environment_variable_feeds_two_settings():
    variables = [v for names in ENV.values() for v in names]
    assert len(variables) == len(set(variables))


def test_redis_url_wins_over_celery_broker_url():
    s = Settings.load({"REDIS_URL": "redis://a:6379/0", "CELERY_BROKER_URL": "redis://b:6379/0"})
    assert s.redis_url == "redis://a:6379/0"


def test_celery_broker_url_is_read_when_redis_url_is_unset():
    s = Settings.load({"CELERY_BROKER_URL": "redis://b:6379/0"})
    assert s.redis_url == "redis://b:6379/0"


def test_empty_variable_counts_as_unset():
    s = Settings.load({"REDIS_URL": "", "CELERY_BROKER_URL": "redis://b:6379/0", "TOOLQ_MODEL": ""})
    assert s.redis_url == "redis://b:6379/0"
    assert s.model == "gpt-5.5"


def test_no_broker_means_the_embedded_default():
    s = Settings.load({})
    assert s.redis_url is None
    assert s.result_backend_url() is None


def test_result_backend_defaults_to_database_1_of_the_broker_keeping_tls_options():
    s = Settings.load({"REDIS_URL": "rediss://:pw@h:6380/0?ssl_cert_reqs=required"})
    assert s.result_backend_url() == "rediss://:pw@h:6380/1?ssl_cert_reqs=required"


def test_explicit_result_url_is_used_as_given():
    s = Settings.load({"REDIS_URL": "redis://h/0", "CELERY_RESULT_BACKEND": "redis://other/3"})
    assert s.result_backend_url() == "redis://other/3"


def test_cli_overrides_beat_the_environment_and_none_means_not_given():
    env = {"TOOLQ_MODEL": "from-env", "TOOLQ_CONCURRENCY": "8"}
    s = Settings.load(env, model="from-flag", concurrency=None)
    assert (s.model, s.concurrency) == ("from-flag", 8)


def test_comma_lists_from_the_environment():
    s = Settings.load({"TOOLQ_QUEUES": "toolq, gpu,,", "TOOLQ_TOOLS": "my.tools"})
    assert s.queues == ["toolq", "gpu"]
    assert s.tools == ["my.tools"]


def test_model_stream_limits_come_from_the_environment():
    s = Settings.load({"TOOLQ_REQUEST_MAX_RETRIES": "0", "TOOLQ_STREAM_MAX_RETRIES": "2",
                       "TOOLQ_STREAM_IDLE_TIMEOUT": "30.5"})
    assert (s.request_max_retries, s.stream_max_retries, s.stream_idle_timeout) == (0, 2, 30.5)


def test_bad_value_names_the_setting_and_its_variable():
    with pytest.raises(ConfigurationError) as e:
        Settings.load({"TOOLQ_CONCURRENCY": "many"})
    assert str(e.value).startswith("invalid setting concurrency (TOOLQ_CONCURRENCY): ")
    assert "\n" not in str(e.value)


def test_bad_value_names_the_variable_that_was_actually_read():
    with pytest.raises(ConfigurationError, match=r"^invalid setting redis_url \(CELERY_BROKER_URL\): must be"):
        Settings.load({"CELERY_BROKER_URL": "amqp://guest@rabbit//"})


def test_bad_flag_value_does_not_blame_the_environment():
    with pytest.raises(ConfigurationError) as e:
        Settings.load({"TOOLQ_CONCURRENCY": "8"}, concurrency=0)
    assert str(e.value).startswith("invalid setting concurrency: ")


def test_tls_url_without_certificate_policy_is_refused_up_front():
    # Celery's result backend would refuse it only at the first task; say so at startup instead.
    with pytest.raises(ConfigurationError, match=r"^invalid setting redis_url \(REDIS_URL\): a rediss:// URL needs"):
        Settings.load({"REDIS_URL": "rediss://:pw@h:6380/0"})


def test_masked_hides_secrets_and_url_passwords():
    s = Settings.load({"REDIS_URL": "redis://:hunter2hunter2@redis:6379/0", "OPENAI_API_KEY": "sk-abcdefghijkl",
                       "FLOWER_USER": "admin", "FLOWER_PASSWORD": "pw"})
    out = s.masked()
    assert out["redis_url"] == "redis://:****@redis:6379/0"
    assert out["openai_api_key"] == "****ijkl"
    assert out["flower_password"] == "****"
    assert out["flower_user"] == "admin"
    assert "hunter2" not in json.dumps(out) and "abcdefgh" not in json.dumps(out)


def test_masking_keeps_every_node_of_a_sentinel_list():
    url = "sentinel://:pw1@s1:26379/0;sentinel://:pw2@s2:26379/0"
    assert mask_url_password(url) == "sentinel://:****@s1:26379/0;sentinel://:****@s2:26379/0"


@pytest.fixture
def clean_env(monkeypatch):
    for names in ENV.values():
        for var in names:
            monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_config_command_prints_effective_settings_with_secrets_masked(clean_env, capsys):
    monkeypatch = clean_env
    monkeypatch.setenv("REDIS_URL", "redis://:topsecretpw@redis:6379/0")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-live-0123456789")
    assert cli.main(["config", "--model", "qwen3", "--concurrency", "2"]) == 0
    text = capsys.readouterr().out
    out = json.loads(text)
    assert out["model"] == "qwen3" and out["concurrency"] == 2
    assert out["redis_url"] == "redis://:****@redis:6379/0"
    assert out["result_url"] == "redis://:****@redis:6379/1"  # the derived default, shown
    assert "topsecretpw" not in text and "0123456789" not in text


def test_config_command_bad_value_is_one_line_and_exit_2(clean_env, capsys):
    clean_env.setenv("TOOLQ_TURN_TIMEOUT", "-1")
    assert cli.main(["config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("toolq: invalid setting turn_timeout (TOOLQ_TURN_TIMEOUT): ")
    assert err.count("\n") == 1


def test_a_sentinel_url_without_its_master_name_is_one_line_naming_the_setting():
    with pytest.raises(ConfigurationError, match=r"invalid setting sentinel_master: REDIS_URL is a sentinel:// URL: "
                                                 r"set TOOLQ_SENTINEL_MASTER"):
        Settings.load({"REDIS_URL": "sentinel://s1:26379/0"})
    with pytest.raises(ConfigurationError, match=r"TOOLQ_RESULT_URL is a sentinel:// URL"):
        Settings.load({"REDIS_URL": "redis://h/0", "TOOLQ_RESULT_URL": "sentinel://s1:26379/1"})

