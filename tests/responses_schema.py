"""The official request schema of `POST /v1/responses`, to check what toolq sends.

`tests/fixtures/openapi/responses-create.json` is `CreateResponse` and everything it references,
cut out of OpenAI's OpenAPI document (source and commit: tests/fixtures/README.md).
"""

from __future__ import annotations

import functools
import json
from typing import Any

from jsonschema import Draft202012Validator
from referencing import Registry
from referencing.jsonschema import DRAFT202012

from tests.paths import FIXTURES

SPEC = FIXTURES / "openapi" / "responses-create.json"
_BASE = "urn:openai:openapi"


def _discriminated_as_any_of(node: Any) -> Any:
    """OpenAPI picks a `oneOf` branch by its `discriminator`; plain JSON Schema would instead
    demand that exactly one branch match, and the spec's branches overlap (a `message` is both an
    `EasyInputMessage` and an `InputMessage`). Read as `anyOf`, which is what the discriminator means."""
    if isinstance(node, list):
        return [_discriminated_as_any_of(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _discriminated_as_any_of(v) for k, v in node.items()}
    if "discriminator" in node and "oneOf" in node:
        node["anyOf"] = node.pop("oneOf")
    return node


@functools.cache
def _validator(schema: str) -> Draft202012Validator:
    document = _discriminated_as_any_of(json.loads(SPEC.read_text()))
    registry = Registry().with_resource(_BASE, DRAFT202012.create_resource(document))
    return Draft202012Validator({"$ref": f"{_BASE}#/components/schemas/{schema}"}, registry=registry)


def schema_errors(instance: Any, schema: str = "CreateResponse") -> list[str]:
    """Each way `instance` breaks the named schema, as `path: message` (empty when it conforms)."""
    errors = sorted(_validator(schema).iter_errors(instance), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{'/'.join(map(str, e.absolute_path)) or '(body)'}: {_brief(e)}" for e in errors]


def _brief(error: Any) -> str:
    """The deepest reason: an `anyOf` over every item type otherwise says only 'is not valid'."""
    while error.context:
        error = min(error.context, key=lambda e: (-len(e.absolute_path), len(e.context)))
    return error.message[:300]
