"""KServe's inference protocols on the inference port, with text in and text out (KServe's LLM
conventions), so a KServe `InferenceService` can front the server:

  v1   POST /v1/models/{model}:predict        {"instances": [prompt, ...], "parameters": {...}}
                                              -> {"predictions": [text, ...]}
  v2   GET  /v2                               server metadata
       GET  /v2/health/live  /v2/health/ready
       GET  /v2/models/{model}[/versions/{v}]          model metadata
       GET  /v2/models/{model}[/versions/{v}]/ready
       POST /v2/models/{model}[/versions/{v}]/infer    one BYTES input tensor of prompts ->
                                                       one BYTES output tensor "text_output"

An instance is a prompt string or an object with one of `prompt`, `text` or `data`; v2's input
tensor holds the prompts as its `data`. Sampling settings go in the request's `parameters`,
named as on /predictions (`max_tokens` or `max_new_tokens`, `temperature`, ...); `n` and
`stream` are refused (one text per prompt). Each prompt is its own engine request
(pagedserve.server.serving.fanout). Replies carry pagedserve's `timings` record, as every other route's do. Errors
are KServe's `{"error": "..."}` (the inference app shapes them).
`/v1/models/{id}` (GET) stays the OpenAI model route.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pagedserve.engine.request.inputs import PromptSpec
from pagedserve.engine.request.outputs import RequestOutput
from pagedserve.handlers.base_handler import HandlerError
from pagedserve.handlers.llm_input import make_sampling_params, rename_max_new_tokens
from pagedserve.handlers.llm_output import timings
from pagedserve.server.common.openapi import server_version
from pagedserve.server.serving.generation import MODEL_KEY, ErrorReply
from pagedserve.server.serving.generation_request import GenerationRequest, run_generation
from pagedserve.server.serving.request_scope import read_json
from pagedserve.server.serving.state import STATE_KEY, ServerState
from pagedserve.server.serving.streaming import StreamFormat
from pagedserve.server.workers.adapters import RegisteredAdapter
from pagedserve.server.workers.rules import InvalidNameError, ModelNotFoundError
from pagedserve.server.workers.version import ModelVersion

MAX_PROMPTS = 32  # instances (v1) or tensor elements (v2) per request
INSTANCE_KEYS = ("prompt", "text", "data")
REFUSED_PARAMETERS = ("n", "stream")
TEXT_TENSOR = {"datatype": "BYTES", "shape": [-1]}
routes = web.RouteTableDef()


def error_body(message: str) -> dict[str, Any]:
    return {"error": message}


# -- health and metadata ---------------------------------------------------------------------


@routes.get("/v2", name="kserve_server_metadata")
async def server_metadata(request: web.Request) -> web.Response:
    """Open inference protocol v2: the server's name, version and extensions."""
    return web.json_response({"name": "pagedserve", "version": server_version(), "extensions": []})


@routes.get("/v2/health/live", name="kserve_live")
async def v2_live(request: web.Request) -> web.Response:
    """v2 liveness: 200 until the server starts draining (as /live)."""
    live = not request.app[STATE_KEY].draining
    return web.json_response({"live": live}, status=200 if live else 503)


@routes.get("/v2/health/ready", name="kserve_ready")
async def v2_ready(request: web.Request) -> web.Response:
    """v2 readiness: 200 when every version that should serve can serve (as /ready)."""
    ready = request.app[STATE_KEY].serving()
    return web.json_response({"ready": ready}, status=200 if ready else 503)


@routes.get("/v2/models/{model}", name="kserve_model_metadata")
@routes.get("/v2/models/{model}/versions/{version}", name="kserve_model_metadata_version")
async def model_metadata(request: web.Request) -> web.Response:
    """v2 model metadata: versions, and the text input and output tensors."""
    version = _resolve(request)
    model = request.app[STATE_KEY].registry.models[version.name]
    return web.json_response(
        {
            "name": version.name,
            "versions": sorted(model.versions),
            "platform": "pagedserve",
            "inputs": [{"name": "text_input", **TEXT_TENSOR}],
            "outputs": [{"name": "text_output", **TEXT_TENSOR}],
        }
    )


@routes.get("/v2/models/{model}/ready", name="kserve_model_ready")
@routes.get("/v2/models/{model}/versions/{version}/ready", name="kserve_model_ready_version")
async def model_ready(request: web.Request) -> web.Response:
    """v2 model readiness: 200 when the version has a ready worker, else 503."""
    version = _resolve(request)
    ready = bool(version.pool.ready_engines()) and not request.app[STATE_KEY].draining
    return web.json_response({"name": version.name, "ready": ready}, status=200 if ready else 503)


# -- inference -------------------------------------------------------------------------------


@routes.post("/v1/models/{model}:predict", name="kserve_v1_predict")
async def v1_predict(request: web.Request) -> web.StreamResponse:
    """KServe v1 predict: `instances` (prompts) -> `predictions` (texts)."""
    body = await read_json(request)
    unknown = sorted(set(body) - {"instances", "parameters"})
    if unknown:
        raise ErrorReply(
            400, f"unknown field {unknown[0]!r}; a v1 request has 'instances' and 'parameters'", param=unknown[0]
        )
    instances = body.get("instances")
    if not isinstance(instances, list):
        raise ErrorReply(400, "instances: required, a list of prompts", param="instances")
    prompts = [_instance_prompt(item, i) for i, item in enumerate(instances)]
    return await _generate(request, prompts, body.get("parameters"), V1Shaper())


@routes.post("/v2/models/{model}/infer", name="kserve_v2_infer")
@routes.post("/v2/models/{model}/versions/{version}/infer", name="kserve_v2_infer_version")
async def v2_infer(request: web.Request) -> web.StreamResponse:
    """v2 infer: one BYTES input tensor of prompts -> the BYTES tensor `text_output`."""
    body = await read_json(request)
    unknown = sorted(set(body) - {"id", "inputs", "outputs", "parameters"})
    if unknown:
        raise ErrorReply(
            400,
            f"unknown field {unknown[0]!r}; a v2 request has 'id', 'inputs', 'outputs' and 'parameters'",
            param=unknown[0],
        )
    request_id = body.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ErrorReply(400, "id: must be a string", param="id")
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise ErrorReply(
            400, "inputs: must be a list of exactly one tensor (the prompts, datatype BYTES)", param="inputs"
        )
    prompts = _tensor_prompts(inputs[0])
    shaper = V2Shaper(request_id=request_id, output_name=_output_name(body.get("outputs")))
    return await _generate(request, prompts, body.get("parameters"), shaper)


async def _generate(request: web.Request, prompts: list[str], parameters: Any, shaper) -> web.StreamResponse:
    started = time.monotonic()
    state: ServerState = request.app[STATE_KEY]
    version, adapter = _resolve_with_adapter(request)
    shaper.model, shaper.version = version.name, version.version
    if adapter is not None:  # answered under the adapter's name
        shaper.model, shaper.version = adapter.name, adapter.version
    if not prompts or len(prompts) > MAX_PROMPTS:
        raise ErrorReply(
            400,
            f"a request holds 1 to {MAX_PROMPTS} prompts, got {len(prompts)}",
            param="inputs" if isinstance(shaper, V2Shaper) else "instances",
        )
    req = GenerationRequest([PromptSpec(text=p) for p in prompts], _sampling_params(parameters))
    lora = adapter.lora if adapter is not None else None
    with version.admit(), adapter.track() if adapter is not None else contextlib.nullcontext():
        return await run_generation(request, state, version, req, shaper, started=started, lora=lora)


def _sampling_params(parameters: Any):
    if parameters is None:
        parameters = {}
    if not isinstance(parameters, dict):
        raise ErrorReply(400, "parameters: must be an object of sampling settings", param="parameters")
    for key in REFUSED_PARAMETERS:
        if key in parameters:
            raise ErrorReply(
                400,
                f"parameters.{key}: not supported on the KServe routes (one text "
                "per prompt, whole replies); use /predictions or the OpenAI routes",
                param=f"parameters.{key}",
            )
    try:
        return make_sampling_params(rename_max_new_tokens(parameters))
    except HandlerError as exc:
        raise ErrorReply(exc.code, f"parameters.{exc}", param=f"parameters.{exc.param or ''}".rstrip(".")) from None


def _instance_prompt(item: Any, i: int) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and len(item) == 1:
        ((key, value),) = item.items()
        if key in INSTANCE_KEYS and isinstance(value, str):
            return value
    raise ErrorReply(
        400,
        f"instances[{i}]: must be a prompt string or an object with one of "
        f"{', '.join(repr(k) for k in INSTANCE_KEYS)} (a string)",
        param=f"instances[{i}]",
    )


def _tensor_prompts(tensor: dict[str, Any]) -> list[str]:
    unknown = sorted(set(tensor) - {"name", "shape", "datatype", "data", "parameters"})
    if unknown:
        raise ErrorReply(400, f"inputs[0]: unknown field {unknown[0]!r}", param=f"inputs[0].{unknown[0]}")
    if not isinstance(tensor.get("name"), str):
        raise ErrorReply(400, "inputs[0].name: required, a string", param="inputs[0].name")
    if tensor.get("datatype") != "BYTES":
        raise ErrorReply(
            400,
            f"inputs[0].datatype: must be \"BYTES\" (text prompts), got {tensor.get('datatype')!r}",
            param="inputs[0].datatype",
        )
    shape, data = tensor.get("shape"), tensor.get("data")
    if not isinstance(data, list):
        raise ErrorReply(400, "inputs[0].data: required, a list of prompt strings", param="inputs[0].data")
    flat = [x for row in data for x in row] if data and all(isinstance(r, list) for r in data) else data
    if not all(isinstance(x, str) for x in flat):
        raise ErrorReply(400, "inputs[0].data: every element must be a prompt string", param="inputs[0].data")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape) or _product(shape) != len(flat):
        raise ErrorReply(
            400,
            f"inputs[0].shape: must list non-negative sizes whose product is the "
            f"number of prompts ({len(flat)}), got {shape!r}",
            param="inputs[0].shape",
        )
    return flat


def _product(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _output_name(outputs: Any) -> str:
    if outputs is None:
        return "text_output"
    if (
        not isinstance(outputs, list)
        or len(outputs) != 1
        or not isinstance(outputs[0], dict)
        or not isinstance(outputs[0].get("name"), str)
    ):
        raise ErrorReply(400, "outputs: must be a list of one {\"name\": ...} (the text output)", param="outputs")
    return outputs[0]["name"]


# -- replies ---------------------------------------------------------------------------------


@dataclass(slots=True)
class V1Shaper:
    """`{"predictions": [text per prompt]}`; whole replies only."""

    model: str = ""
    version: str = ""
    stream_format: StreamFormat = StreamFormat.NDJSON  # never streamed

    def whole(self, out: RequestOutput, total_s: float) -> dict[str, Any]:
        return {"predictions": _texts(out), "timings": timings(out, total_s)}

    def opening(self, n: int) -> None:
        return None

    def chunk(self, deltas) -> dict[str, Any]:
        raise AssertionError("the KServe routes do not stream")

    closing = chunk

    def error(self, code: int, message: str) -> dict[str, Any]:
        return error_body(message)


@dataclass(slots=True)
class V2Shaper(V1Shaper):
    """The v2 inference response: one BYTES output tensor of texts, one per prompt."""

    request_id: str | None = None
    output_name: str = "text_output"

    def whole(self, out: RequestOutput, total_s: float) -> dict[str, Any]:
        texts = _texts(out)
        body: dict[str, Any] = {"model_name": self.model, "model_version": self.version}
        if self.request_id is not None:
            body["id"] = self.request_id
        body["outputs"] = [{"name": self.output_name, "datatype": "BYTES", "shape": [len(texts)], "data": texts}]
        body["timings"] = timings(out, total_s)
        return body


def _texts(out: RequestOutput) -> list[str]:
    return [c.text for c in sorted(out.outputs, key=lambda c: c.index)]


# -- helpers ---------------------------------------------------------------------------------


def _resolve(request: web.Request) -> ModelVersion:
    return _resolve_with_adapter(request)[0]


def _resolve_with_adapter(request: web.Request) -> tuple[ModelVersion, RegisteredAdapter | None]:
    """The version the path names; for a LoRA adapter's name, its base version and the adapter."""
    state = request.app[STATE_KEY]
    name, version = request.match_info["model"], request.match_info.get("version")
    adapter = None
    try:
        found = state.registry.resolve(name, version)
    except ModelNotFoundError as exc:
        adapter = state.adapters.get(name) if version is None else None
        if adapter is None:
            raise ErrorReply(404, str(exc)) from None
        found = adapter.base
    except InvalidNameError as exc:
        raise ErrorReply(400, str(exc), param="model") from None
    request[MODEL_KEY] = found.name
    return found, adapter
