"""Deferred-tool search: BM25 over each tool's name, namespace and description, as Codex ranks its
deferred tools. Both sides use it: the orchestrator answers `tool_search` from its own registry,
and the built-in `tool_search` tool (a worker) from its catalog. No tool is registered here.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

from toolq.core.calls import ToolSearchPayload
from toolq.core.catalog import ToolSpec
from toolq.core.errors import RespondToModel

DEFAULT_LIMIT = 8
_K1 = 1.2
_B = 0.75


def search_catalog(catalog: Iterable[ToolSpec], payload: ToolSearchPayload) -> list[dict[str, Any]]:
    """The model specs of the deferred tools that match, best first. The orchestrator answers
    tool_search with this from its own registry (the tools it will expose), not on a worker."""
    query = _tokens(payload.query)
    if not payload.query.strip():
        raise RespondToModel("query must not be empty")
    limit = DEFAULT_LIMIT if payload.limit is None else payload.limit
    if limit < 1:
        raise RespondToModel("limit must be greater than zero")
    return group_specs(rank([s for s in catalog if s.deferred and s.offered], query)[:limit])


def rank(specs: list[ToolSpec], query: list[str]) -> list[ToolSpec]:
    """The specs that share a term with the query, best BM25 score first."""
    docs = [Counter(_tokens(f"{s.name} {s.namespace or ''} {s.description}")) for s in specs]
    if not docs or not query:
        return []
    avg_len = sum(sum(d.values()) for d in docs) / len(docs) or 1.0
    scored = []
    for spec, doc in zip(specs, docs, strict=True):
        length = sum(doc.values())
        score = 0.0
        for term in set(query):
            tf = doc.get(term, 0)
            if not tf:
                continue
            df = sum(1 for d in docs if term in d)
            idf = math.log((len(docs) - df + 0.5) / (df + 0.5) + 1)
            score += idf * tf * (_K1 + 1) / (tf + _K1 * (1 - _B + _B * length / avg_len))
        if score > 0:
            scored.append((-score, spec.namespace or "", spec.name, spec))
    scored.sort(key=lambda t: t[:3])
    return [t[3] for t in scored]


def group_specs(specs: list[ToolSpec]) -> list[dict[str, Any]]:
    """Model specs in rank order; a namespace's tools are grouped where its best match ranks."""
    out: list[dict[str, Any]] = []
    namespaces: dict[str, dict[str, Any]] = {}
    for spec in specs:
        if spec.namespace is None:
            out.append(spec.model_spec())
            continue
        group = namespaces.get(spec.namespace)
        if group is None:
            group = {
                "type": "namespace",
                "name": spec.namespace,
                "description": f"Tools in the {spec.namespace} namespace.",
                "tools": [],
            }
            namespaces[spec.namespace] = group
            out.append(group)
        group["tools"].append(spec.model_spec())
    return out


def _tokens(text: str) -> list[str]:
    # Split snake_case and camelCase names into words, so `create_event` matches "create event".
    text = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", text)
    return re.findall(r"[a-z0-9]+", text.lower())
