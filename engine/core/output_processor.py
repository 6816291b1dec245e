"""Turns EngineCoreOutputs (token ids) into RequestOutputs (text): detokenization, stop strings,
logprobs, and the fan-out (`add_request`) and fan-in of the `n` child requests of one prompt.
The offline `LLM` and the server's `AsyncLLM` both submit what `add_request` returns."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from pagedserve.engine.core.messages import EngineCoreRequest
from pagedserve.engine.request.detokenizer import IncrementalDetokenizer
from pagedserve.engine.request.inputs import EngineInput
from pagedserve.engine.request.outputs import CompletionOutput, FinishReason, RequestOutput, TokenLogprob
from pagedserve.engine.sampling.params import SamplingParams, child_seed
from pagedserve.engine.scheduler.output import EngineCoreOutput, Logprobs


def child_request_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"


def child_sampling_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child i of an n-way request: n=1, and seed+i so children differ but stay reproducible."""
    return msgspec.structs.replace(params, n=1, seed=child_seed(params.seed, index))


@dataclass(slots=True)
class _ChildState:
    index: int
    detokenizer: IncrementalDetokenizer
    completion: CompletionOutput


@dataclass(slots=True)
class _ParentState:
    output: RequestOutput
    num_unfinished: int


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._children: dict[str, tuple[str, _ChildState]] = {}
        self._parents: dict[str, _ParentState] = {}

    def add_request(
        self, request_id: str, inp: EngineInput, *, priority: int = 0, arrival_time: float | None = None
    ) -> list[EngineCoreRequest]:
        """Register a request and fan it out: returns the engine requests to submit, one per
        child of an n-way request (one request, under `request_id` itself, when n == 1)."""
        if request_id in self._parents:
            raise ValueError(f"duplicate request id {request_id!r}")
        params = inp.params
        out = RequestOutput(request_id, inp.prompt, list(inp.token_ids), [])
        requests = []
        for i in range(params.n):
            completion = CompletionOutput(
                index=i, text="", token_ids=[], logprobs=[] if params.logprobs is not None else None
            )
            detok = IncrementalDetokenizer(
                self.tokenizer,
                inp.token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            out.outputs.append(completion)
            child_id = child_request_id(request_id, i) if params.n > 1 else request_id
            self._children[child_id] = (request_id, _ChildState(i, detok, completion))
            requests.append(
                EngineCoreRequest(
                    child_id,
                    list(inp.token_ids),
                    child_sampling_params(params, i),
                    priority,
                    arrival_time,
                    cache_salt=inp.cache_salt,
                    pooling_params=inp.pooling,
                    lora=inp.lora,
                    kv_produce=inp.kv_produce,
                )
            )
        self._parents[request_id] = _ParentState(out, params.n)
        return requests

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns (request outputs that changed, child ids stopped by a stop string: abort them)."""
        changed: dict[str, RequestOutput] = {}
        to_abort: list[str] = []
        for eco in outputs:
            entry = self._children.get(eco.request_id)
            if entry is None:
                continue
            parent_id, child = entry
            parent = self._parents[parent_id]
            completion = child.completion
            stop_str = child.detokenizer.update(eco.new_token_ids)
            completion.token_ids = child.detokenizer.output_token_ids
            if completion.logprobs is not None and eco.new_logprobs:
                completion.logprobs.extend(self._convert_logprobs(lp) for lp in eco.new_logprobs)
            finish_reason, stop_reason = eco.finish_reason, eco.stop_reason
            if stop_str is not None:
                if not eco.finished:
                    to_abort.append(eco.request_id)
                finish_reason, stop_reason = FinishReason.STOP, stop_str
            if finish_reason is not None:
                child.detokenizer.finish()
                completion.finish_reason = finish_reason
                completion.stop_reason = stop_reason
                completion.error = eco.error
                completion.embedding = eco.pooled
                del self._children[eco.request_id]
                parent.num_unfinished -= 1
            completion.text = child.detokenizer.output_text
            parent.output.num_cached_tokens = max(parent.output.num_cached_tokens, eco.num_cached_tokens)
            parent.output.num_external_cached_tokens = max(
                parent.output.num_external_cached_tokens, eco.num_external_cached_tokens
            )
            parent.output.kv_transfer_s = max(parent.output.kv_transfer_s, eco.kv_transfer_s)
            parent.output.kv_transfer_bytes = max(parent.output.kv_transfer_bytes, eco.kv_transfer_bytes)
            if parent.output.prefix_miss is None and eco.prefix_miss is not None:
                parent.output.prefix_miss = eco.prefix_miss
            if parent.num_unfinished == 0:
                parent.output.finished = True
                del self._parents[parent_id]
            changed[parent_id] = parent.output
        return list(changed.values()), to_abort

    def mark_aborted(self, request_id: str) -> RequestOutput | None:
        """Finish a request's output as aborted (its unfinished completions get ABORT)."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for completion in parent.output.outputs:
            if completion.finish_reason is None:
                completion.finish_reason = FinishReason.ABORT
        parent.output.finished = True
        return parent.output

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns its child ids still known to the engine."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        ids = [cid for cid, (pid, _) in self._children.items() if pid == request_id]
        for cid in ids:
            del self._children[cid]
        return ids

    def _convert_logprobs(self, lp: Logprobs) -> dict[int, TokenLogprob]:
        ranks = [lp.sampled_rank] + list(range(1, len(lp.token_ids)))
        return {
            tok: TokenLogprob(logprob, rank, self.tokenizer.decode([tok]))
            for tok, logprob, rank in zip(lp.token_ids, lp.logprobs, ranks)
        }

    @property
    def num_unfinished(self) -> int:
        return len(self._parents)
