"""The OpenAPI description of each port (`OPTIONS /`, `GET /api-description`): generated from
the route tables, it lists every route with a summary, and a route added without a description
is caught. In-process, no model."""

from __future__ import annotations

import pytest
from aiohttp import web

from pagedserve.server.app.inference import build_inference_app
from pagedserve.server.app.serve import build_state
from pagedserve.server.common import openapi
from pagedserve.server.common.config import ServerConfig
from pagedserve.server.management.app import build_management_app


@pytest.fixture(scope="module")
def apps():
    state = build_state(ServerConfig(snapshot_path=None), make_engine=None, keys=None)
    yield {"inference": build_inference_app(state), "management": build_management_app(state)}
    state.executor.shutdown()


@pytest.fixture(scope="module")
def server(inprocess_factory):
    return inprocess_factory()


def served(app: web.Application) -> set[tuple[str, str]]:
    """(method, path) of every route the app serves (aiohttp's automatic HEAD aside)."""
    return {
        (r.method.lower(), openapi.PATH_PARAM.sub(r"{\1}", r.resource.canonical))
        for r in app.router.routes()
        if r.method != "HEAD"
    }


@pytest.mark.parametrize("api", ["inference", "management"])
def test_every_route_has_a_description(apps, api):
    assert openapi.undescribed(apps[api]) == []


@pytest.mark.parametrize("api", ["inference", "management"])
def test_the_description_lists_every_route(server, apps, api):
    for method, path in (("OPTIONS", "/"), ("GET", "/api-description")):
        r = server.request(method, api, path)
        assert r.status == 200, r.text
        doc = r.json()
        assert doc["openapi"].startswith("3.") and doc["info"]["title"] == f"pagedserve {api} API"
        listed = {(m, p) for p, ops in doc["paths"].items() for m in ops}
        assert listed == served(apps[api])
        for p, ops in doc["paths"].items():
            for m, op in ops.items():
                assert op["summary"] and op["operationId"], (m, p)
                declared = {x["name"] for x in op.get("parameters", ()) if x["in"] == "path"}
                assert declared == set(openapi.PATH_PARAM.findall(p)), (m, p)
    assert server.request("OPTIONS", api, "/", token=None).status == 401  # behind the key like the rest


def test_the_description_carries_bodies_and_query_parameters(server):
    inference = server.get("inference", "/api-description").json()["paths"]
    assert set(inference["/predictions/{model}"]["put"]["requestBody"]["content"]) >= {
        "application/json",
        "text/plain",
        "multipart/form-data",
    }
    assert "/v1/models/{model}:predict" in inference and "/v2/models/{model}/infer" in inference
    management = server.get("management", "/api-description").json()["paths"]
    register = {p["name"]: p for p in management["/models"]["post"]["parameters"]}
    assert register["url"]["required"] and register["startup_timeout"]["schema"]["anyOf"][0]["minimum"] == 1
    assert {p["name"] for p in management["/token"]["get"]["parameters"]} == {"type"}


def test_a_route_without_a_description_is_caught():
    async def undocumented(request):
        return web.json_response({})

    async def documented(request):
        """Says what it does."""
        return web.json_response({})

    app = web.Application()
    app.add_routes([web.get("/a", documented), web.post("/b/{x}", undocumented)])
    assert openapi.undescribed(app) == ["POST /b/{x}"]
    doc = openapi.describe(app, "t", {})
    assert doc["paths"]["/a"]["get"]["summary"] == "Says what it does."
    assert doc["paths"]["/b/{x}"]["post"]["parameters"][0]["name"] == "x"
