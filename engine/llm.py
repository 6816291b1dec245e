"""Offline batch generation: `LLM(model=...).generate(prompts, params)`, like vLLM's."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from engine.config import EngineConfig
from engine.core_client import InprocClient
from engine.core_messages import EngineCoreRequest
from engine.engine_core import EngineCore
from engine.output_processor import OutputProcessor, child_sampling_params
from engine.outputs import RequestOutput
from engine.process_setup import configure_engine_process
from engine.request import Request
from engine.sampling_params import SamplingParams

PromptType = str | Sequence[int]
Message = dict[str, str]


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


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
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, or a list of token ids); outputs keep prompt order.

        `priority` (one int per prompt, lower first) matters with scheduling_policy="priority".
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts given")
        params_list = self._params_list(sampling_params, len(prompts))
        items = []
        for prompt in prompts:
            if isinstance(prompt, str):
                items.append((prompt, self.tokenizer.encode(prompt, add_special_tokens=False)))
            else:
                items.append((None, list(prompt)))
        return self._run(items, params_list, priority)

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
        items = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
            items.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(items, self._params_list(sampling_params, len(items)))

    @staticmethod
    def _params_list(params, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        return params

    def _run(
        self,
        items: list[tuple[str | None, list[int]]],
        params_list: list[SamplingParams],
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        engine = self.engine
        priorities = list(priority) if priority is not None else [0] * len(items)
        if len(priorities) != len(items) or not all(isinstance(p, int) for p in priorities):
            raise ValueError(f"priority needs one integer per prompt ({len(items)})")
        # Validate everything before submitting anything: a bad prompt leaves the engine untouched.
        requests = []
        for (_, token_ids), params in zip(items, params_list):
            req = Request(f"check-{len(requests)}", token_ids, params)
            engine.validate_request(req)
            requests.append(req)
        processor = OutputProcessor(self.tokenizer)
        order = []
        for (text, token_ids), params, prio in zip(items, params_list, priorities):
            req_id = f"offline-{next(self._counter)}"
            order.append(req_id)
            for i, child_id in enumerate(processor.add_request(req_id, text, token_ids, params)):
                self.client.add_request(
                    EngineCoreRequest(child_id, list(token_ids), child_sampling_params(params, i), priority=prio)
                )
        finished: dict[str, RequestOutput] = {}
        try:
            while processor.num_unfinished:
                if not engine.has_unfinished_requests():
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

