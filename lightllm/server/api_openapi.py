"""Request-body schemas in the OpenAPI document.

The generation handlers read the raw body and validate it themselves (so every error gets the
OpenAI error shape and names the field), which means FastAPI cannot see their body models.
Each POST route therefore declares its body through ``openapi_extra`` with a reference to the
pydantic model's JSON schema, and :func:`install_request_schemas` adds those schemas (and the
models they nest) to ``components.schemas``, so fuzzers and client generators can work from
``/openapi.json``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from fastapi import FastAPI
from pydantic import BaseModel

_REF_TEMPLATE = "#/components/schemas/{model}"


def request_body(model_cls: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body is validated into ``model_cls``."""
    schema = {"$ref": _REF_TEMPLATE.format(model=model_cls.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_request_schemas(app: FastAPI, models: Iterable[type[BaseModel]]) -> None:
    """Make ``app.openapi()`` include the JSON schemas of ``models`` as components."""
    models = list(models)
    build_default: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = build_default()
        components = document.setdefault("components", {}).setdefault("schemas", {})
        for model_cls in models:
            schema = model_cls.model_json_schema(ref_template=_REF_TEMPLATE)
            components.update(schema.pop("$defs", {}))
            components[model_cls.__name__] = schema
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]
