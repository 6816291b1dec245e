"""The one typed request that every API surface hands to the shared generation path.

A surface's folder (pagedserve.server.openai, .torchserve, .kserve, .ollama, .anthropic) reads
its body once, into its own schema (checked there: a refusal names the body's field), and turns
it into a `GenerationRequest`: the prompts, the sampling params with the surface's defaults
applied, whether to stream, and the engine request's own fields. `run_generation` is the path
from there down, the same for every surface: each prompt is prepared once
(pagedserve.server.serving.generation.prepare: tokenized, the model's default max_tokens
applied, checked against the workers' limits by pagedserve.engine.request.inputs.validate_input,
the one validation a request gets), a worker is picked, and the request runs and is answered.
Nothing on the way down calls back into a surface's module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.request.inputs import EngineInput, PromptSpec
from pagedserve.engine.request.pooling import PoolingParams
from pagedserve.engine.sampling.params import SamplingParams
from pagedserve.server.serving.fanout import FanOut
from pagedserve.server.serving.generation import ErrorReply, WholeShaper, prepare, respond
from pagedserve.server.serving.state import ServerState
from pagedserve.server.workers.version import ModelVersion


@dataclass(slots=True)
class GenerationRequest:
    """A request as its surface parsed it: ready to prepare, nothing left to check but what
    needs the model (the prompt's length in tokens, the token ids' range)."""

    prompts: list[PromptSpec]  # one engine request each (several: answered as one, fanout)
    params: SamplingParams
    stream: bool = False
    priority: int = 0  # lower first, under scheduling_policy "priority"
    cache_salt: str | None = None  # a tenant's salt: its prefix-cache hits are its own
    kv_produce: bool = False  # kv_transfer_params.do_remote_decode: the prompt's KV written through
    pooling: PoolingParams | None = None  # set: the prompts' embeddings, no tokens
    prompt_field: str = "prompt"  # the body's name for the prompt, in a refusal of it

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("a GenerationRequest holds at least one prompt")


async def run_generation(
    request: web.Request,
    state: ServerState,
    version: ModelVersion,
    req: GenerationRequest,
    shaper: WholeShaper | Callable[[list[EngineInput]], WholeShaper],
    *,
    started: float,
    lora: LoRARequest | None = None,
) -> web.StreamResponse:
    """Prepare each prompt, run them (several: one reply, `n` choices per prompt) and answer.
    `shaper`: the reply's shape, or a function of the prepared inputs that makes it (a
    completion that echoes its prompts' texts); streamed replies need a full `Shaper`."""
    client = request.remote or ""
    try:
        jobs = [
            await prepare(
                state,
                version,
                spec,
                req.params,
                client=client,
                pooling=req.pooling,
                lora=lora,
                priority=req.priority,
                cache_salt=req.cache_salt,
                kv_produce=req.kv_produce,
            )
            for spec in req.prompts
        ]
    except ErrorReply as exc:  # the engine calls the prompt `prompt`; the body may not
        if exc.param == "prompt":
            exc.param = req.prompt_field
        raise
    job = jobs[0] if len(jobs) == 1 else FanOut(jobs, req.params.n).prepared()
    shape = shaper([j.input for j in jobs]) if callable(shaper) else shaper
    return await respond(request, state, version, job, shape, stream=req.stream, started=started)
