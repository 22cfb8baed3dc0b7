"""One tool in two versions, as during a rolling upgrade: a worker loads the version its
environment names (`TOOLQ_TEST_UPGRADE`); the test process, an orchestrator, builds each (`declare`)."""

from __future__ import annotations

import os

from pydantic import BaseModel

from toolq.core.catalog import Catalog, ToolContext, ToolSpec, tool

VERSION_ENV = "TOOLQ_TEST_UPGRADE"


class UpgradeArgs(BaseModel):
    text: str


def declare(version: str, catalog: Catalog | None = None) -> ToolSpec:
    """`upgraded`, version `version`: the description differs, so the declaration digest does."""

    @tool(name="upgraded", description=f"Echo the text (version {version} of this module).", catalog=catalog)
    def upgraded(args: UpgradeArgs, ctx: ToolContext) -> str:
        return f"v{version}: {args.text}"

    return upgraded.tool_spec


if os.environ.get(VERSION_ENV):  # workers only: the test process builds both versions itself
    declare(os.environ[VERSION_ENV])
