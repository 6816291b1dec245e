"""An OpenAPI 3.0 description of a port, generated from its route table, as TorchServe offers
it (`curl -X OPTIONS localhost:8080`, `GET /api-description`).

Every route is described by its handler: the first paragraph of the handler's docstring is the
operation's summary, the path's `{name}` parts are its path parameters, and a `Body` the app
declares for a handler adds the request's content types and query parameters (a msgspec
Struct, whose JSON schema gives each parameter's type and bounds). A route whose handler has no
docstring is listed by `undescribed` (a test keeps that list empty), so a new route cannot go
out without its description.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import msgspec
from aiohttp import web

OPENAPI_VERSION = "3.0.1"
PATH_PARAM = re.compile(r"\{([^{}:]+)(?::[^{}]*)?\}")
_SKIPPED_METHODS = frozenset({"HEAD", "*"})  # aiohttp adds HEAD beside every GET


@dataclass(frozen=True, slots=True)
class Body:
    """What a route takes besides its path parameters."""

    content_types: tuple[str, ...] = ()
    query: type | None = None  # a msgspec Struct: the query parameters


def summary(handler: Any) -> str | None:
    """The first paragraph of the handler's docstring, on one line; None when it has none."""
    doc = inspect.getdoc(handler)
    if not doc or not doc.strip():
        return None
    return " ".join(doc.strip().split("\n\n")[0].split())


def operations(app: web.Application) -> list[tuple[str, str, Any, str | None]]:
    """(method, path, handler, route name) of every route of `app`, as served."""
    out = []
    for route in app.router.routes():
        if route.method in _SKIPPED_METHODS or route.resource is None:
            continue
        path = PATH_PARAM.sub(r"{\1}", route.resource.canonical)
        out.append((route.method, path, route.handler, route.name))
    return out


def undescribed(app: web.Application) -> list[str]:
    """`METHOD /path` of every route whose handler has no description."""
    return [f"{method} {path}" for method, path, handler, _ in operations(app) if summary(handler) is None]


def describe(app: web.Application, title: str, bodies: Mapping[Any, Body]) -> dict[str, Any]:
    """The OpenAPI document of `app`'s routes."""
    paths: dict[str, dict[str, Any]] = {}
    for method, path, handler, name in operations(app):
        operation: dict[str, Any] = {
            "operationId": name or f"{method.lower()} {path}",
            "summary": summary(handler) or "",
            "responses": {
                "200": {"description": "OK"},
                "default": {"description": "an error, shaped as this route's errors are"},
            },
        }
        parameters = [
            {"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in PATH_PARAM.findall(path)
        ]
        body = bodies.get(handler, Body())
        if body.query is not None:
            parameters += _query_parameters(body.query)
        if parameters:
            operation["parameters"] = parameters
        if body.content_types:
            operation["requestBody"] = {"content": {t: {"schema": _body_schema(t)} for t in body.content_types}}
        paths.setdefault(path, {})[method.lower()] = operation
    return {"openapi": OPENAPI_VERSION, "info": {"title": title, "version": server_version()}, "paths": paths}


def routes(title: str, bodies: Mapping[Any, Body] | None = None) -> list[web.RouteDef]:
    """`OPTIONS /` and `GET /api-description` answering `describe(app, title, bodies)`."""
    bodies = dict(bodies or {})

    async def api_description(request: web.Request) -> web.Response:
        """This port's OpenAPI description (also `OPTIONS /`)."""
        return web.json_response(describe(request.app, title, bodies))

    return [
        web.options("/", api_description, name="api_description_options"),
        web.get("/api-description", api_description, name="api_description"),
    ]


def _query_parameters(struct: type) -> list[dict[str, Any]]:
    (ref,), components = msgspec.json.schema_components([struct], ref_template="{name}")
    schema = components[ref["$ref"]]
    required = set(schema.get("required", ()))
    return [
        {"name": name, "in": "query", "required": name in required, "schema": prop}
        for name, prop in schema.get("properties", {}).items()
    ]


def _body_schema(content_type: str) -> dict[str, Any]:
    if content_type == "application/json":
        return {"type": "object"}
    if content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
        return {"type": "object", "properties": {"data": {"type": "string"}}}
    return {"type": "string"}


def server_version() -> str:
    """pagedserve's installed version."""
    try:
        return metadata.version("pagedserve")
    except metadata.PackageNotFoundError:
        return "unknown"
