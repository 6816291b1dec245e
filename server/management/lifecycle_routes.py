"""Management routes of the model lifecycle (pagedserve.server.workers.lifecycle), on the management port:

    PUT /models/{m}/{v}/sleep   free the version's weights and KV pools, keep its processes
    PUT /models/{m}/{v}/wake    load them again (room made in the budget first)
    PUT /models/{m}/{v}/pin     never unload it (keep-alive, LRU eviction)
    PUT /models/{m}/{v}/unpin

Authenticated like every management call, and only with the model API enabled
(`--enable-model-api`; 405 otherwise). A sleep while requests are in flight, or of a version
with nothing loaded, is a 409; a wake that cannot fit the budget a 507 naming both sizes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from pagedserve.server.serving.generation import ErrorReply
from pagedserve.server.serving.state import STATE_KEY
from pagedserve.server.workers.version import ModelVersion


def _check_model_api(request: web.Request) -> None:
    if not request.app[STATE_KEY].config.enable_model_api:
        raise ErrorReply(
            405,
            "Requested method is not allowed: the model lifecycle API is "
            "disabled; start the server with --enable-model-api (or "
            "enable_model_api: true) to allow it",
        )


def _route(act: Callable[[web.Request, ModelVersion], Awaitable[str]]):
    async def handle(request: web.Request) -> web.Response:
        _check_model_api(request)
        state = request.app[STATE_KEY]
        entry = state.registry.resolve(request.match_info["model"], request.match_info["version"])
        return web.json_response({"status": await act(request, entry)})

    handle.__doc__ = act.__doc__  # the route's description (pagedserve.server.common.openapi)
    return handle


async def _sleep(request: web.Request, entry: ModelVersion) -> str:
    """Free the version's weights and KV pools, keeping its processes; needs --enable-model-api."""
    await request.app[STATE_KEY].registry.lifecycle.sleep(entry)
    return f"Model {entry.name} version {entry.version} is asleep"


async def _wake(request: web.Request, entry: ModelVersion) -> str:
    """Load a sleeping version again (room made in the memory budget first; no room: 507)."""
    await request.app[STATE_KEY].registry.lifecycle.wake(entry)  # no room: 507
    return f"Model {entry.name} version {entry.version} is awake"


async def _pin(request: web.Request, entry: ModelVersion) -> str:
    """Never unload the version (keep-alive, LRU eviction)."""
    request.app[STATE_KEY].registry.set_pinned(entry, True)
    return f"Model {entry.name} version {entry.version} is pinned"


async def _unpin(request: web.Request, entry: ModelVersion) -> str:
    """Let the version be unloaded again."""
    request.app[STATE_KEY].registry.set_pinned(entry, False)
    return f"Model {entry.name} version {entry.version} is no longer pinned"


ROUTES = [
    web.put("/models/{model}/{version}/sleep", _route(_sleep)),
    web.put("/models/{model}/{version}/wake", _route(_wake)),
    web.put("/models/{model}/{version}/pin", _route(_pin)),
    web.put("/models/{model}/{version}/unpin", _route(_unpin)),
]
