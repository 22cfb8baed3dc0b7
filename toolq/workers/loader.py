"""Fill the process-wide catalog: the built-in tools, then the user's tool modules.

Apart from `catalog` so that the catalog never imports the tools that import it.
"""

from __future__ import annotations

import importlib

from toolq.core.catalog import CATALOG, Catalog
from toolq.core.errors import ConfigurationError
from toolq.core.import_path import TOOLS_PATH_ENV


def load_catalog(modules: list[str] | tuple[str, ...] = ()) -> Catalog:
    """The built-in tools plus the user's modules (each registers its tools on import)."""
    importlib.import_module("toolq.workers.tools")
    for m in modules:
        try:
            importlib.import_module(m)
        except ModuleNotFoundError as e:
            if e.name and m.startswith(e.name):
                raise ConfigurationError(f"tool module {m!r} not found: put the folder that holds it on "
                                         f"{TOOLS_PATH_ENV} (never a workspace: toolq does not import from the "
                                         "current directory), or install it") from None
            raise
    return CATALOG
