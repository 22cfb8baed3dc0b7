"""Sentinel URLs (Celery's form) and what every Redis client of toolq is built from."""

from __future__ import annotations

import pytest

from toolq.cli import main as cli
from toolq.core.redis_target import RedisTarget, parse_redis_url
from toolq.core.settings import ENV, Settings
from toolq.workers.config import broker_target, celery_config

CELERY_FORM = "sentinel://:pw@s1:26379;sentinel://:pw@s2:26380;sentinel://:pw@s3/0"


def test_celery_form_names_every_sentinel_the_data_nodes_password_and_the_database():
    t = parse_redis_url(CELERY_FORM, "mymaster")
    assert t.sentinels == (("s1", 26379), ("s2", 26380), ("s3", 26379))
    assert (t.master, t.password, t.username, t.db) == ("mymaster", "pw", None, 0)
    assert t.is_sentinel and t.sentinel_kwargs() == {}
    # Celery's backend and kombu read the first part only: each part says it all
    assert t.celery_url() == "sentinel://:pw@s1:26379/0;sentinel://:pw@s2:26380/0;sentinel://:pw@s3:26379/0"
    assert t.with_db(1).celery_url().endswith("s3:26379/1")


def test_a_password_on_the_first_part_only_counts_for_all_and_the_sentinels_own_is_apart():
    t = parse_redis_url("sentinel://user:p%40ss@s1:26379;sentinel://s2:26379/2", "m", sentinel_password="spw")
    assert (t.username, t.password, t.db) == ("user", "p@ss", 2)
    assert t.sentinel_kwargs() == {"password": "spw"}
    assert "p@ss" not in repr(t) and "spw" not in repr(t)


def test_a_plain_url_is_left_as_it_is():
    for url in ("redis://:pw@h:6379/0", "rediss://h:6380/0?ssl_cert_reqs=required", "unix:///tmp/r.sock"):
        t = parse_redis_url(url, "ignored")
        assert not t.is_sentinel and t.celery_url() == url
    assert RedisTarget("rediss://h:6380/0?ssl_cert_reqs=required").with_db(1).url == \
        "rediss://h:6380/1?ssl_cert_reqs=required"


@pytest.mark.parametrize("url, problem", [
    ("sentinel://s1:26379", "needs the master's name"),
    ("sentinel://s1:port/0", "malformed sentinel:// URL part"),
    ("sentinel://s1:26379;redis://h:6379/0", "must start with sentinel://"),
    ("sentinel://:a@s1:26379;sentinel://:b@s2:26379", "different passwords"),
    ("sentinel://s1:26379/0;sentinel://s2:26379/1", "different databases"),
    ("sentinel://s1:26379/x", "database must be a number"),
    ("sentinel://:26379/0", "names no host"),
    ("sentinel://s1:26379/0?ssl_cert_reqs=required", r"takes no \?options"),
])
def test_a_malformed_sentinel_url_is_one_line(url, problem):
    with pytest.raises(ValueError, match=problem) as e:
        parse_redis_url(url, None if "master" in problem else "m")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("url", [
    "sentinel://:s3cr3tpw/xyz@h1:26379",  # an unencoded '/': urlsplit reads 's3cr3tpw' as the port
    "sentinel://:pw@h1;redis://:topsecretpassword@h2",  # an unencoded ';' splits the password
])
def test_a_malformed_sentinel_url_never_shows_its_password(url):
    """helper-30 (red team): both errors echoed the password, into terminals and worker logs."""
    with pytest.raises(ValueError) as e:
        parse_redis_url(url, "m")
    assert "s3cr3t" not in str(e.value) and "topsecret" not in str(e.value), str(e.value)
    assert "percent-encoded" in str(e.value)


def test_settings_give_the_result_backend_database_1_of_the_same_sentinels():
    s = Settings.load({"REDIS_URL": CELERY_FORM, "TOOLQ_SENTINEL_MASTER": "mymaster",
                       "TOOLQ_SENTINEL_PASSWORD": "sentinel-secret"})
    result = s.result_target()
    assert result is not None and result.db == 1 and result.master == "mymaster"
    assert s.result_backend_url() == result.celery_url()
    assert s.masked()["sentinel_password"] == "****cret"
    assert "pw" not in s.masked()["redis_url"]


def test_celery_gets_the_sentinel_transport_options_for_the_broker_and_the_results():
    s = Settings.load({"REDIS_URL": CELERY_FORM, "TOOLQ_SENTINEL_MASTER": "mymaster",
                       "TOOLQ_SENTINEL_PASSWORD": "spw"})
    conf = celery_config(s, 60.0)
    assert conf["broker_url"].startswith("sentinel://:pw@s1:26379/0;")
    assert conf["broker_transport_options"]["master_name"] == "mymaster"
    assert conf["broker_transport_options"]["sentinel_kwargs"] == {"password": "spw"}
    assert conf["result_backend"].startswith("toolq.workers.backend:NoSubscribeSentinelBackend+sentinel://")
    assert conf["result_backend_transport_options"] == {"master_name": "mymaster",
                                                        "sentinel_kwargs": {"password": "spw"}}
    # what a worker's own clients read back from its app's configuration
    app_conf = type("Conf", (), conf)
    target = s.redis_target()
    assert target is not None and broker_target(app_conf).celery_url() == target.celery_url()
    assert broker_target(app_conf).sentinel_kwargs() == {"password": "spw"}


def test_a_plain_broker_gets_no_sentinel_options():
    conf = celery_config(Settings(redis_url="redis://h:6379/0"), 60.0)
    assert "master_name" not in conf["broker_transport_options"]
    assert conf["result_backend_transport_options"] == {}
    assert conf["result_backend"] == "toolq.workers.backend:NoSubscribeRedisBackend+redis://h:6379/1"


def test_the_cli_stops_at_a_bad_sentinel_url_with_one_line_and_exit_2(monkeypatch, capsys):
    for names in ENV.values():
        for var in names:
            monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("REDIS_URL", "sentinel://s1:26379/0")
    assert cli.main(["config"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("toolq: invalid setting sentinel_master: REDIS_URL is a sentinel:// URL")
    assert err.count("\n") == 1


def test_the_client_factory_follows_sentinel_and_leaves_a_plain_url_as_from_url_made_it():
    """No I/O: pools connect at their first command."""
    import asyncio

    import redis.asyncio.sentinel as asentinel
    import redis.sentinel as sentinel

    from toolq.workers import redis_clients

    t = parse_redis_url(CELERY_FORM, "mymaster", sentinel_password="spw")
    sync = redis_clients.sync_client(t, client_name="x")
    assert isinstance(sync.connection_pool, sentinel.SentinelConnectionPool)
    manager = sync.connection_pool.sentinel_manager
    assert sync.connection_pool.service_name == "mymaster"
    assert sync.connection_pool.connection_kwargs["password"] == "pw"
    assert sync.connection_pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs["password"] == "spw"
    closed: list[bool] = []
    manager.close = lambda: closed.append(True)
    sync.close()
    assert closed == [True], "closing the client closes its connections to the sentinels"

    async def check() -> None:
        r = redis_clients.async_client(t, max_connections=3, blocking=True, client_name="ledger", socket_timeout=5)
        pool = r.connection_pool
        assert isinstance(pool, asentinel.SentinelConnectionPool) and pool.max_connections == 3
        own = redis_clients.dedicated_pool(r, "cancels")
        assert isinstance(own, asentinel.SentinelConnectionPool) and own.max_connections == 1
        assert own.connection_kwargs["client_name"] == "cancels" and own.sentinel_manager is pool.sentinel_manager
        await own.aclose()
        await r.aclose()
        plain = redis_clients.async_client("redis://:pw@h:6379/2", client_name="x")
        assert plain.connection_pool.connection_kwargs["db"] == 2
        assert not isinstance(plain.connection_pool, asentinel.SentinelConnectionPool)
        await plain.aclose()

    asyncio.run(check())
    with pytest.raises(ValueError, match="needs the master's name"):
        redis_clients.sync_client("sentinel://s1:26379/0")
