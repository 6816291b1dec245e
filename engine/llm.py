"""Offline batch generation: `LLM(model=...).generate(prompts, params)`, like vLLM's.

The same request path as the server's: prepare (pagedserve.engine.request.inputs) -> generate (the n-way fan-out in
OutputProcessor.add_request, an in-process engine client) -> RequestOutputs."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.client import InprocClient
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.core.output_processor import OutputProcessor
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.model.tokenizer import load_tokenizer
from pagedserve.engine.platform.process_setup import configure_engine_process
from pagedserve.engine.request.inputs import EngineInput, PromptSpec, pooling_sampling_params, prepare_input
from pagedserve.engine.request.outputs import RequestOutput
from pagedserve.engine.request.pooling import PoolingParams
from pagedserve.engine.sampling.params import SamplingParams

PromptType = str | Sequence[int]
Message = dict[str, str]
LoRAType = LoRARequest | str | Path | None  # an adapter, or its PEFT folder (named after the folder)


class LLM:
    """An in-process engine plus tokenizer. `model` is a model directory or a packaged archive
    (`.mar`, `.tar.gz`, or an archive folder); engine options are EngineConfig's fields."""

    def __init__(self, model: str | Path, **engine_options) -> None:
        self.config = EngineConfig(model=str(model), **engine_options)
        configure_engine_process(self.config)  # an offline LLM owns its process: threads, seed, malloc
        self.engine = EngineCore(self.config)  # `model` may be a directory or an archive
        self.client = InprocClient(self.engine)  # the same interface as a worker process's client
        self.tokenizer = load_tokenizer(self.engine.model_dir)
        self._counter = itertools.count()

    def shutdown(self) -> None:
        """Release what the engine holds outside its memory (the KV offload tier: queued disk
        writes finish, LMCache's threads end). Idempotent; the LLM is unusable afterwards."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        lora: LoRAType | Sequence[LoRAType] = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, or a list of token ids); outputs keep prompt order.

        `priority` (one int per prompt, lower first) matters with scheduling_policy="priority".
        `lora`: a LoRA adapter for every prompt, or a list with one per prompt (None: the base
        model): a LoRARequest, or a PEFT adapter folder. A bad adapter raises ValueError before
        anything runs.
        """
        return self._prepare_and_run(_specs(prompts), sampling_params, priority, lora)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling: PoolingParams | None = None,
    ) -> list[list[float]]:
        """Each prompt's embedding (pagedserve.engine.request.pooling: the last token's final hidden state,
        L2-normalised by default), in prompt order."""
        pooling = pooling or PoolingParams()
        inputs = [
            prepare_input(self.tokenizer, spec, pooling_sampling_params(), self.engine.input_limits, pooling)
            for spec in _specs(prompts)
        ]
        vectors = [out.outputs[0].embedding for out in self.run(inputs)]
        if any(v is None for v in vectors):
            raise RuntimeError("a pooling request finished without its embedding")
        return cast(list[list[float]], vectors)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if not messages:
            raise ValueError("no messages given")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        specs = [PromptSpec(messages=conv, add_generation_prompt=add_generation_prompt) for conv in conversations]
        return self._prepare_and_run(specs, sampling_params)

    def prepare(self, spec: PromptSpec, params: SamplingParams) -> EngineInput:
        """The prepare step (tokenize, chat template, validate) for this engine; InvalidInput
        (a ValueError naming the field) for a request it must refuse. Offline, as in vLLM,
        max_tokens beyond max_model_len runs and ends with "length"."""
        return prepare_input(self.tokenizer, spec, params, self.engine.input_limits)

    def run(self, inputs: Sequence[EngineInput], priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for prepared inputs until all finish; outputs keep input order."""
        priorities = list(priority) if priority is not None else [0] * len(inputs)
        if len(priorities) != len(inputs) or not all(isinstance(p, int) for p in priorities):
            raise ValueError(f"priority needs one integer per prompt ({len(inputs)})")
        processor = OutputProcessor(self.tokenizer)
        order = []
        for inp, prio in zip(inputs, priorities):
            req_id = f"offline-{next(self._counter)}"
            order.append(req_id)
            for request in processor.add_request(req_id, inp, priority=prio):
                self.client.add_request(request)
        finished: dict[str, RequestOutput] = {}
        try:
            while processor.num_unfinished:
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("engine has no work left but requests are unfinished")
                outputs, to_abort = processor.process_outputs(self.client.get_output().outputs)
                self.client.abort_requests(to_abort)
                for out in outputs:
                    if out.finished:
                        finished[out.request_id] = out
        except BaseException:
            for req_id in order:
                self.client.abort_requests(processor.abort_request(req_id))
            raise
        return [finished[r] for r in order]

    def _prepare_and_run(
        self,
        specs: list[PromptSpec],
        params,
        priority: Sequence[int] | None = None,
        lora: LoRAType | Sequence[LoRAType] = None,
    ) -> list[RequestOutput]:
        # Prepare everything before submitting anything: a bad prompt or adapter leaves the engine untouched.
        inputs = [self.prepare(spec, p) for spec, p in zip(specs, _params_list(params, len(specs)))]
        for inp, ref in zip(inputs, _lora_list(lora, len(specs))):
            if ref is not None:
                self.engine.runner.lora.load(ref)  # raises ValueError for an adapter that does not fit
            inp.lora = ref
        return self.run(inputs, priority)


def _specs(prompts: PromptType | Sequence[PromptType]) -> list[PromptSpec]:
    """One prompt (text or token ids) or a list of them -> their PromptSpecs."""
    many: Sequence[PromptType]
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        many = [cast(PromptType, prompts)]  # one prompt: text, or token ids
    else:
        many = cast(Sequence[PromptType], prompts)
    if not many:
        raise ValueError("no prompts given")
    return [PromptSpec(text=p) if isinstance(p, str) else PromptSpec(token_ids=list(p)) for p in many]


def _lora_list(lora, n: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, (LoRARequest, str, Path)):
        lora = [lora] * n
    lora = list(lora)
    if len(lora) != n:
        raise ValueError(f"got {len(lora)} LoRA adapters for {n} prompts")
    return [
        ref if ref is None or isinstance(ref, LoRARequest) else LoRARequest(Path(ref).name, str(ref)) for ref in lora
    ]


def _params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
