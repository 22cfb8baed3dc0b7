"""tool_search: ranks deferred tools and returns their specs, namespaced ones grouped."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from tests.unit.tools import call
from toolq.core.catalog import Catalog, ToolReturn, tool
from toolq.core.errors import RespondToModel
from toolq.workers.tools.tool_search import PARAMETERS, tool_search


class Args(BaseModel):
    title: str


def make_catalog() -> Catalog:
    cat = Catalog()

    @tool(namespace="calendar", deferred=True, catalog=cat)
    def create_event(args: Args, ctx) -> str:
        "Create a calendar event with a title and time."

    @tool(namespace="calendar", deferred=True, catalog=cat)
    def list_events(args: Args, ctx) -> str:
        "List upcoming calendar events."

    @tool(deferred=True, catalog=cat)
    def send_email(args: Args, ctx) -> str:
        "Send an email message to a recipient."

    @tool(catalog=cat)
    def visible_calendar_tool(args: Args, ctx) -> str:
        "Always loaded calendar helper: never a search result."

    return cat


def spec_of(name: str):
    return next(s for s in make_catalog() if s.name == name)


def search(tmp_path, **payload) -> ToolReturn:
    return call(tool_search, tmp_path, payload, catalog=make_catalog())


def test_best_match_comes_first_and_namespaced_tools_are_grouped(tmp_path):
    r = search(tmp_path, query="create calendar event")
    assert r.output == ""
    assert [t["type"] for t in r.tools] == ["namespace"]
    group = r.tools[0]
    assert (group["name"], [t["name"] for t in group["tools"]]) == ("calendar", ["create_event", "list_events"])
    assert group["tools"][0] == spec_of("create_event").model_spec()


def test_plain_deferred_tools_come_back_as_function_specs(tmp_path):
    r = search(tmp_path, query="email")
    assert r.tools == [spec_of("send_email").model_spec()]


def test_only_deferred_tools_are_searched(tmp_path):
    names = [t["name"] for t in search(tmp_path, query="visible helper").tools]
    assert "visible_calendar_tool" not in names


def test_limit_caps_the_matches(tmp_path):
    r = search(tmp_path, query="calendar event email", limit=1)
    assert len(r.tools) == 1 and len(r.tools[0].get("tools", [r.tools[0]])) == 1


def test_no_match_returns_no_tools(tmp_path):
    assert search(tmp_path, query="kubernetes").tools == []


@pytest.mark.parametrize(("payload", "message"), [({"query": "  "}, "query must not be empty"),
                                                  ({"query": "x", "limit": 0}, "limit must be greater than zero")])
def test_bad_payloads_are_clear_errors(tmp_path, payload, message):
    with pytest.raises(RespondToModel, match=f"^{message}$"):
        search(tmp_path, **payload)


def test_spec_is_a_client_tool_search_with_codex_parameters():
    spec = tool_search.tool_spec
    assert (spec.kind, spec.name, spec.namespace, spec.parallel) == ("tool_search", "tool_search", None, True)
    model_spec = spec.model_spec()
    assert (model_spec["type"], model_spec["execution"]) == ("tool_search", "client")
    assert model_spec["parameters"] == PARAMETERS == {
        "type": "object",
        "properties": {"query": {"type": "string"}, "limit": {"type": "number"}},
        "required": ["query"],
        "additionalProperties": False,
    }
