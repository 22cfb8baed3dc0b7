"""Red team of the front doors (issue 29), pure parts: who the exec-server lets in (a browser page,
DNS rebinding, the token), how a client's file URIs map to the workspace, and the Redis key a
client's processId becomes. Integration attacks: tests/integration/test_hostile_front_doors.py."""

from __future__ import annotations

import pytest
from websockets.datastructures import Headers

from toolq.core.front_doors import open_event
from toolq.core.signing import Signer
from toolq.frontdoors.exec_server.paths import Root
from toolq.frontdoors.exec_server.protocol import RpcError
from toolq.frontdoors.exec_server.server import browser_refused, token_accepted
from toolq.frontdoors.exec_server.session import process_key


def headers(**kw: str) -> Headers:
    h = Headers()
    for name, value in kw.items():
        h[name.replace("_", "-")] = value
    return h


@pytest.mark.parametrize("host, origin", [
    ("evil.example:8765", None),                    # DNS rebinding: the page's own name
    ("127.0.0.1.nip.io:8765", None),
    ("localhost.evil.example:8765", None),
    ("127.0.0.1:8765", "https://evil.example"),     # a cross-site page
    ("127.0.0.1:8765", "null"),                     # a sandboxed iframe, a file:// page
    ("127.0.0.1:8765", "http://localhost.evil.example"),
    ("127.0.0.1:8765", "http://127.0.0.1.evil.example:8765"),
    ("0.0.0.0:8765", None),
])
def test_a_browser_page_is_refused_with_no_token(host: str, origin: str | None) -> None:
    h = headers(Host=host, **({"Origin": origin} if origin is not None else {}))
    assert browser_refused(None, h) is not None


def test_no_host_at_all_is_refused_and_loopback_clients_pass() -> None:
    assert browser_refused(None, headers()) is not None
    for host in ("127.0.0.1:1", "localhost:1", "[::1]:1", "127.9.9.9:1", "localhost"):
        assert browser_refused(None, headers(Host=host)) is None, host
        assert browser_refused(None, headers(Host=host, Origin="http://localhost:3000")) is None
    # with a token the page cannot pass the token check anyway
    assert browser_refused("t", headers(Host="evil.example", Origin="https://evil.example")) is None


@pytest.mark.parametrize("given_headers, path", [
    ({}, "/"), ({"Authorization": "Bearer "}, "/"), ({"Authorization": "Bearer secret-tokeX"}, "/"),
    ({"Authorization": "Bearersecret-token"}, "/x"), ({"Authorization": "Basic secret-token"}, "/"),
    ({}, "/?token="), ({}, "/?token=secret-toke"), ({}, "/?token=secret-token-and-more"),
    ({}, "/?tok=secret-token"),
])
def test_a_wrong_token_is_refused(given_headers: dict[str, str], path: str) -> None:
    assert not token_accepted("secret-token", headers(**given_headers), path)


def test_the_right_token_passes_either_way() -> None:
    assert token_accepted("secret-token", headers(Authorization="Bearer secret-token"), "/")
    assert token_accepted("secret-token", headers(Authorization="bearer secret-token"), "/")  # RFC 7235: any case
    assert token_accepted("secret-token", headers(), "/?token=secret-token")
    assert token_accepted("secret-token", headers(), "/?a=1&token=secret-token")


@pytest.mark.parametrize("uri", [
    "file:///work/ws/%2e%2e/secret", "file:///work/ws/%2E%2E/secret", "file:///work/ws/a/%2e%2e/%2e%2e/secret",
    "file:///work/ws%2f..%2fsecret", "file:///work/ws/../ws2/x", "file:///work/ws2/x", "file:///work/w",
    "file:///work", "file:///", "file:////work/ws/../../etc/passwd", "file://localhost/work/ws/../x",
])
def test_a_uri_out_of_the_root_is_not_served(uri: str) -> None:
    assert Root("/work/ws").relative(uri) is None


@pytest.mark.parametrize("uri", [
    "file:///work/ws/a%00b", "http://127.0.0.1/work/ws/x", "file://evil.example/work/ws/x", "/work/ws/x",
    "file:work/ws/x", "file:///work/ws/x?y=1", "file:///work/ws/x#y", "ws/x", "",
])
def test_a_uri_that_is_no_local_absolute_path_is_invalid(uri: str) -> None:
    with pytest.raises(RpcError):
        Root("/work/ws").relative(uri)


def test_uris_inside_the_root_map_to_workspace_paths_without_dots() -> None:
    root = Root("/work/ws")
    assert root.relative("file:///work/ws") == ""
    assert root.relative("file:///work/ws/") == ""
    assert root.relative("file:///work/ws/a/./b/../c%20d") == "a/c d"
    assert root.relative("file:///work/ws/.git/config") == ".git/config"  # the worker refuses writes there
    for uri in ("file:///work/ws/a/..%2f..%2fx", "file:///work/ws/%2e"):
        rel = root.relative(uri)
        assert rel is None or ".." not in rel.split("/"), (uri, rel)


def test_two_process_ids_never_share_a_redis_key() -> None:
    """A processId that is not a key's characters becomes a prefix and a digest; an id spelt as
    another's digest form must not land on the same stream (its events would be read as the other's)."""
    ids = ["a/b", "a b", "a_b", "../x", "x" * 300, "x" * 301, "é", "e"]
    ids += [process_key(i) for i in ids]  # each id's key, sent as an id of its own
    keys = [process_key(i) for i in ids]
    assert len(set(keys)) == len(set(ids)), {i: k for i, k in zip(ids, keys, strict=True)}
    for k in keys:
        assert len(k) <= 200 and all(c.isascii() and (c.isalnum() or c in "_.:-") for c in k)


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"a":' * 50_000, b"1e400", b"NaN", b'"x"', b"[]", b"\xff\xfe", b""])
def test_a_forged_stream_entry_is_refused_never_raised(raw: bytes) -> None:
    """Anyone who can write to Redis may XADD anything into a process's stream: deep JSON raised
    RecursionError out of open_event, and the exec-server took its process for lost."""
    assert open_event(Signer("k" * 32), "toolq:proc:t:k", {b"event": raw, b"sig": b"00"}) is None
