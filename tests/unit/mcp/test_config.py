"""MCP server config: `--mcp NAME=COMMAND ARGS...`, Claude Desktop JSON, Codex TOML, one-line errors."""

from __future__ import annotations

import json

import pytest

from toolq.core.errors import ConfigurationError
from toolq.core.settings import Settings
from toolq.workers.mcp.config import load_file, load_servers, parse_flag


def test_a_flag_is_split_as_a_shell_would():
    name, config = parse_flag("git=uvx mcp-server-git --repository '/my repo'")
    assert name == "git"
    assert (config.command, config.args) == ("uvx", ["mcp-server-git", "--repository", "/my repo"])
    assert config.transport == "stdio"


def test_a_flag_with_a_url_is_streamable_http():
    name, config = parse_flag("docs=https://example.com/mcp")
    assert (name, config.url, config.transport) == ("docs", "https://example.com/mcp", "http")


@pytest.mark.parametrize("value, says", [
    ("git", "expected NAME=COMMAND"),
    ("git=", "no command"),
    ("git=echo 'unclosed", "No closing quotation"),
    ("my server=x", "letters, digits"),
    ("a.b=x", "letters, digits"),
    ("functions=x", "also names the top-level tools"),
])
def test_a_bad_flag_is_one_clear_line(value, says):
    with pytest.raises(ConfigurationError) as e:
        parse_flag(value)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_claude_desktop_json(tmp_path):
    path = tmp_path / "claude_desktop_config.json"
    path.write_text(json.dumps({"mcpServers": {
        "fs": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"],
               "env": {"DEBUG": "1"}, "cwd": "/tmp"},
    }}))
    servers = load_file(path)
    assert servers["fs"].args[-1] == "/tmp" and servers["fs"].env == {"DEBUG": "1"} and servers["fs"].cwd == "/tmp"


def test_codex_toml_with_timeouts_url_and_disabled_servers(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("""
model = "gpt-5.5"

[mcp_servers.git]
command = "mcp-server-git"
args = ["--repository", "."]
startup_timeout_sec = 5
tool_timeout_sec = 9.5

[mcp_servers.docs]
url = "https://example.com/mcp"

[mcp_servers.off]
command = "nothing"
enabled = false
""")
    servers = load_file(path)
    assert set(servers) == {"git", "docs"}
    assert (servers["git"].startup_timeout_sec, servers["git"].tool_timeout_sec) == (5, 9.5)
    assert servers["docs"].url == "https://example.com/mcp"


@pytest.mark.parametrize("body, says", [
    ('{"mcpServers": {"x": {"command": "a", "url": "http://b"}}}', "either `command`"),
    ('{"mcpServers": {"x": {}}}', "either `command`"),
    ('{"mcpServers": {"x": {"command": "a", "argz": []}}}', "argz: unknown setting"),
    ('{"mcpServers": {"x": {"command": "a", "tool_timeout_sec": -1}}}', "tool_timeout_sec"),
    ('{"mcpServers": {"x": {"url": "ftp://b"}}}', "http:// or https://"),
    ('{"mcpServers": {"x": {"command": "a", "env_vars": ["REDIS_URL"]}}}', "never passed to a server"),
    ('{"mcpServers": {"x": {"command": "a", "env_vars": ["OTEL_EXPORTER_OTLP_HEADERS"]}}}', "never passed to a server"),
    ('{"mcpServers": {"x": {"command": "a", "env_vars": ["OTEL_EXPORTER_OTLP_TRACES_HEADERS"]}}}',
     "never passed to a server"),
    ('{"mcpServers": {"x": {"command": "a", "env_vars": ["PROMETHEUS_MULTIPROC_DIR"]}}}', "never passed to a server"),
    ('{"mcpServers": {"x": {"command": "a", "env_vars": ["TOOLQ_SIGNING_KEY"]}}}', "never passed to a server"),
    ('{"servers": {}}', "no `mcpServers` table"),
    ('{"mcpServers": ', "not valid JSON"),
])
def test_a_bad_file_is_one_line_naming_the_server_and_field(tmp_path, body, says):
    path = tmp_path / "mcp.json"
    path.write_text(body)
    with pytest.raises(ConfigurationError) as e:
        load_file(path)
    assert says in str(e.value) and "\n" not in str(e.value) and str(path) in str(e.value)


def test_a_name_in_both_the_file_and_a_flag_is_refused(tmp_path):
    path = tmp_path / "mcp.json"
    path.write_text('{"mcpServers": {"git": {"command": "a"}}}')
    with pytest.raises(ConfigurationError, match="already configured"):
        load_servers(["git=b"], path)
    assert set(load_servers(["time=t"], path)) == {"git", "time"}


def test_the_environment_names_only_basics_and_the_config_never_the_fleets_secrets():
    worker_env = {"PATH": "/bin", "HOME": "/root", "LANG": "C.UTF-8", "REDIS_URL": "redis://:pw@h",
                  "TOOLQ_SIGNING_KEY": "k" * 40, "OPENAI_API_KEY": "sk-x", "FLOWER_PASSWORD": "pw",
                  "CELERY_BROKER_URL": "redis://h", "GITHUB_TOKEN": "ghp", "AWS_SECRET_ACCESS_KEY": "a"}
    _, config = parse_flag("git=mcp-server-git")
    assert config.environment(worker_env) == {"PATH": "/bin", "HOME": "/root", "LANG": "C.UTF-8"}
    config = config.model_copy(update={"env": {"GIT_AUTHOR_NAME": "bot"}, "env_vars": ["GITHUB_TOKEN"]})
    assert config.environment(worker_env) == {"PATH": "/bin", "HOME": "/root", "LANG": "C.UTF-8",
                                              "GITHUB_TOKEN": "ghp", "GIT_AUTHOR_NAME": "bot"}


def test_settings_read_the_config_file_from_the_environment(tmp_path):
    settings = Settings.load(env={"TOOLQ_MCP_CONFIG": str(tmp_path / "m.toml")}, mcp=["a=b"])
    assert settings.mcp_config == tmp_path / "m.toml" and settings.mcp == ["a=b"]


def test_toolq_mcp_holds_one_server_per_line():
    settings = Settings.load(env={"TOOLQ_MCP": "git=mcp-server-git --repository a,b\ntime=mcp-server-time\n"})
    assert settings.mcp == ["git=mcp-server-git --repository a,b", "time=mcp-server-time"]
