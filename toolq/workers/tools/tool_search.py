"""`tool_search`: find deferred tools for the model (Responses `tool_search` with client execution).

Deferred tools (`deferred=True`) are left out of the request's tool list; the model searches them
by keywords and the matching specs come back in the `tool_search_output`. The ranking lives in
`toolq.core.search`, which the orchestrator imports without registering this tool.
"""

from __future__ import annotations

from toolq.core.calls import ToolSearchArgs, ToolSearchPayload
from toolq.core.catalog import CATALOG, ToolContext, ToolReturn, plain_parameters, tool
from toolq.core.search import search_catalog

PARAMETERS = plain_parameters(ToolSearchArgs)


@tool(kind="tool_search", parameters=PARAMETERS)
def tool_search(payload: ToolSearchPayload, ctx: ToolContext) -> ToolReturn:
    """Searches the tools that are available but not yet loaded, by keywords from their names and
    descriptions. Matching tools become callable from the next step."""
    return ToolReturn(output="", tools=search_catalog(ctx.catalog if ctx.catalog is not None else CATALOG, payload))
