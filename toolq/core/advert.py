"""What a worker advertises in the fleet catalog, and the per-tool queues it routes by.

Shared by both sides, with no I/O: workers write these records (`toolq.workers.presence`), the
orchestrator reads them (`toolq.orchestrator.transport.catalog_reader`). Keys: `toolq.core.keys`.

A call goes to the queue of its tool's exact declaration, `toolq.t.<tool>.<digest[:12]>`, which
only workers that serve that declaration consume: a worker never receives a tool it has not
loaded, and the two declarations of a rolling upgrade never meet each other's workers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel

from toolq.core.calls import PayloadKind, ToolName
from toolq.core.catalog import DEFAULT_QUEUE, Catalog, ToolSpec
from toolq.core.environments import host_queue

TOOL_QUEUE_PREFIX = "toolq.t."


def tool_queue(spec: ToolSpec) -> str:
    """The queue of one declaration (the digest covers the namespace, so `ns.name` cannot clash)."""
    return f"{TOOL_QUEUE_PREFIX}{spec.tool_name}.{spec.digest()[:12]}"


def consumer_queues(catalog: Catalog, consumed: Iterable[str]) -> list[str]:
    """The per-tool queues a worker adds to the queues it was told to consume: those of its tools
    declared on one of them, so `--queues X` still restricts a worker to X's tools."""
    wanted = set(consumed)
    return sorted({tool_queue(s) for s in catalog if s.queue in wanted})


def broker_lists(queues: Iterable[str], catalog: Catalog, host: str) -> dict[str, list[str]]:
    """Each declared queue and the broker lists its calls wait in: itself, its tools' own queues
    (where calls are sent, `tool_queue`) and those queues on `host` (an environment's calls)."""
    return {q: [q, *(tool_queue(s) for s in catalog if s.queue == q),
                *(host_queue(host, tool_queue(s)) for s in catalog if s.queue == q)] for q in queues}


class ToolRef(BaseModel):
    """One tool a worker serves, as its record lists it: enough to route and to list it."""

    name: str
    namespace: str | None = None
    digest: str
    queue: str
    """The queue the tool is declared on (`@tool(queue=...)`), which `--queues` selects by."""
    route: str
    """The per-declaration queue calls are sent to (`tool_queue`)."""
    kind: PayloadKind
    retiring: bool = False
    """No longer listed by its source (an MCP server listed its tools anew): still routed to this
    worker for a short grace, so a call carrying it is answered by the worker, but not offered to
    the model by new turns (`FleetCatalog.declarations`)."""

    @property
    def tool_name(self) -> ToolName:
        return ToolName(namespace=self.namespace, name=self.name)

    @classmethod
    def of(cls, spec: ToolSpec) -> ToolRef:
        return cls(name=spec.name, namespace=spec.namespace, digest=spec.digest(), queue=spec.queue,
                   route=tool_queue(spec), kind=spec.kind)


class ToolAdvert(BaseModel):
    """One declaration in full, stored once per digest: what an orchestrator needs to show the tool
    to the model without having loaded its module (tools whose specs are known only at runtime)."""

    name: str
    digest: str
    declaration: dict[str, Any]
    """`ToolSpec.declaration()`: the model-visible spec and everything the digest covers."""
    shell_like: bool = False
    offered: bool = True
    """`ToolSpec.offered` (not in the digest, as shell_like)."""
    whole_output: bool = False
    """`ToolSpec.whole_output` (not in the digest)."""
    session_gone: str | None = None
    """`ToolSpec.session_gone` (not in the digest)."""
    module: str | None = None
    """Where the worker got it: the Python module of its handler (None if it has none)."""

    @classmethod
    def of(cls, spec: ToolSpec) -> ToolAdvert:
        module = getattr(spec.handler, "__module__", None) if spec.handler is not None else None
        return cls(name=spec.name, digest=spec.digest(), declaration=spec.declaration(), shell_like=spec.shell_like,
                   offered=spec.offered, whole_output=spec.whole_output, session_gone=spec.session_gone,
                   module=module)

    def to_spec(self) -> ToolSpec | None:
        """The declaration as a `ToolSpec` with no handler (an orchestrator binds and sends it; a
        worker runs it); None if the record does not hash to its digest (stale or forged)."""
        d, model = self.declaration, self.declaration.get("spec") or {}
        kind = d.get("kind", "function")
        try:
            spec = ToolSpec(name=self.name, namespace=d.get("namespace"), description=model.get("description", ""),
                            kind=kind, parameters=None if kind == "custom" else model.get("parameters"),
                            strict=bool(model.get("strict", False)), grammar=model.get("format"),
                            parallel=bool(d.get("parallel", True)), queue=d.get("queue", DEFAULT_QUEUE),
                            timeout=d.get("timeout", 60.0), idempotent=bool(d.get("idempotent", False)),
                            deferred=bool(d.get("deferred", False)), shell_like=self.shell_like,
                            offered=self.offered, whole_output=self.whole_output,
                            session_gone=self.session_gone)
        except (TypeError, ValueError):
            return None
        return spec if spec.digest() == self.digest else None


class WorkerAdvert(BaseModel):
    """One worker process instance. Liveness is per instance, not per node name: a worker killed
    and restarted under the same `--name` is a new instance with a new id."""

    instance: str
    hostname: str
    """Celery's node name (`fleet0@host`), as Flower and `toolq status` show it."""
    host: str
    pid: int
    started_at: float
    concurrency: int
    queues: list[str]
    """The queues it was told to consume (`--queues`, or every queue of its catalog)."""
    sandbox: str | None = None
    env_host: str | None = None
    """The host id its environments are placed under (`toolq.core.environments`); None: it serves none."""
    env_mode: str | None = None
    """How its host makes environments: `overlay`, or `copy` where it cannot mount one."""
    draining: bool = False
    """In warm shutdown: it finishes its calls but takes no new ones, so it serves nothing."""
    tools: list[ToolRef]

    def serves(self, name: ToolName, digest: str) -> bool:
        return not self.draining and any(t.digest == digest and t.tool_name == name for t in self.tools)
