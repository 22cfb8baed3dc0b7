"""The fleet catalog's records and per-tool queues (toolq/core/advert.py)."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from toolq.core.advert import ToolAdvert, ToolRef, WorkerAdvert, consumer_queues, tool_queue
from toolq.core.catalog import Catalog, ToolContext, tool
from toolq.workers.loader import load_catalog


class Args(BaseModel):
    text: str


def declared(**kw) -> Catalog:
    catalog = Catalog()

    @tool(name="echo", catalog=catalog, **kw)
    def echo(args: Args, ctx: ToolContext) -> str:
        """Echo."""
        return args.text

    return catalog


def only(catalog: Catalog):
    (spec,) = list(catalog)
    return spec


@pytest.mark.parametrize("spec", list(load_catalog(["tests.integration.testtools"])), ids=lambda s: str(s.tool_name))
def test_every_declaration_survives_the_catalog_with_its_digest_and_model_spec(spec):
    rebuilt = ToolAdvert.model_validate_json(ToolAdvert.of(spec).model_dump_json()).to_spec()
    assert rebuilt is not None
    assert (rebuilt.digest(), rebuilt.model_spec(), rebuilt.shell_like) == (spec.digest(), spec.model_spec(),
                                                                           spec.shell_like)


def test_a_record_that_does_not_hash_to_its_digest_is_refused():
    advert = ToolAdvert.of(only(declared()))
    forged = advert.model_copy(update={"declaration": {**advert.declaration, "timeout": 1}})
    assert forged.to_spec() is None


def test_each_declaration_has_its_own_queue_and_namespaces_do_not_clash():
    v1, v2 = only(declared()), only(declared(timeout=5))
    ns = only(declared(namespace="workspace"))
    assert tool_queue(v1) == f"toolq.t.echo.{v1.digest()[:12]}"
    assert len({tool_queue(v1), tool_queue(v2), tool_queue(ns)}) == 3
    assert tool_queue(ns).startswith("toolq.t.workspace.echo.")


def test_queues_restrict_a_worker_to_the_tools_declared_on_them():
    catalog = Catalog([only(declared(queue="gpu")), *[s for s in load_catalog() if s.queue == "toolq"][:2]])
    gpu = [tool_queue(s) for s in catalog if s.queue == "gpu"]
    assert consumer_queues(catalog, ["gpu"]) == gpu
    assert set(consumer_queues(catalog, ["gpu", "toolq"])) == {tool_queue(s) for s in catalog}
    assert consumer_queues(catalog, ["other"]) == []


def test_a_draining_worker_serves_nothing():
    spec = only(declared())
    record = WorkerAdvert(instance="i" * 32, hostname="w@h", host="h", pid=1, started_at=0.0, concurrency=4,
                          queues=["toolq"], tools=[ToolRef.of(spec)])
    assert record.serves(spec.tool_name, spec.digest())
    assert not record.serves(spec.tool_name, only(declared(timeout=5)).digest())
    assert not record.model_copy(update={"draining": True}).serves(spec.tool_name, spec.digest())
