"""A minimal inference port, used only while `server.inference_app` (the full one: streaming,
OpenAI routes) is absent: /ping, /live, /ready and non-streaming POST /predictions."""

from __future__ import annotations

import asyncio
import time
import uuid

from aiohttp import web

from handlers.base_handler import HandlerError
from handlers.llm_input import (
    check_fits,
    decode_body,
    parse_predictions_body,
    render_prompt,
)
from handlers.llm_output import prediction_response
from server.auth import auth_middleware
from server.errors import error_response
from server.registry import ModelNotFoundError, NoWorkerError, QueueFullError
from server.state import STATE_KEY, ServerState


async def _ping(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    healthy = state.registry.all_ready()
    return web.json_response({"status": "Healthy" if healthy else "Unhealthy"},
                             status=200 if healthy else 500)


async def _live(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def _ready(request: web.Request) -> web.Response:
    ready = request.app[STATE_KEY].registry.all_ready()
    return web.json_response({"status": "ready" if ready else "not ready"},
                             status=200 if ready else 503)


async def _predict(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    name, version = request.match_info["model"], request.match_info.get("version")
    start = time.monotonic()
    try:
        entry = state.registry.resolve(name, version)
        parsed = parse_predictions_body(decode_body(await request.read()))
        if parsed.stream:
            raise HandlerError("streaming needs the full inference app")
        loop = asyncio.get_running_loop()
        text, token_ids = await loop.run_in_executor(state.executor, render_prompt,
                                                     entry.tokenizer, parsed.prompt)
        with entry.admit():
            worker = entry.pick_worker()
            check_fits(token_ids, parsed.params, entry.max_model_len)
            request_id = uuid.uuid4().hex
            final = None
            async for out in worker.generate(request_id, token_ids, parsed.params, prompt=text):
                final = out
    except ModelNotFoundError as exc:
        return error_response(404, str(exc))
    except HandlerError as exc:
        return error_response(exc.code, str(exc))
    except ValueError as exc:
        return error_response(400, str(exc))
    except (NoWorkerError, QueueFullError) as exc:
        return error_response(503, str(exc), headers={"Retry-After": "1"})
    except RuntimeError as exc:  # EngineDeadError: the worker died mid-request
        return error_response(500, f"the worker failed: {exc}")
    state.metrics.observe_output(entry.name, final)
    body = prediction_response(entry.name, final, request_id, time.monotonic() - start)
    return web.json_response(body, headers={"x-request-id": request_id})


def build_fallback_inference_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[auth_middleware(state.inference_key)],
                          client_max_size=state.config.max_request_size)
    app[STATE_KEY] = state
    app.router.add_get("/ping", _ping)
    app.router.add_get("/live", _live)
    app.router.add_get("/ready", _ready)
    app.router.add_post("/predictions/{model}", _predict)
    app.router.add_post("/predictions/{model}/{version}", _predict)
    return app


