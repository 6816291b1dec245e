"""What the engine core drives each step: the configured drafter (n-gram or suffix), and for
`method: auto` the adaptive choice of each request's draft length, fed with the step's
measured time and each verification's result."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from pagedserve.engine.config.speculative import SpecMethod, SpeculativeConfig
from pagedserve.engine.request.request import Request
from pagedserve.engine.scheduler.output import ModelRunnerOutput, SchedulerOutput
from pagedserve.engine.spec_decode.adaptive import AdaptiveSpeculation
from pagedserve.engine.spec_decode.ngram import NgramProposer, can_draft
from pagedserve.engine.spec_decode.suffix import SuffixProposer

if TYPE_CHECKING:
    import torch


class Runner(Protocol):
    """What the speculator reads of the model runner (pagedserve.engine.runner.model_runner,
    which drives it): a draft model gets the same dtype, device and KV block layout."""

    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, runner: Runner) -> None:
        self.config = config
        self.max_model_len = max_model_len
        k = config.num_speculative_tokens
        # auto: requests none of whose drafts was kept yet look up n-grams (no suffix index).
        self.ngram = (
            NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
            if config.method in (SpecMethod.NGRAM, SpecMethod.AUTO)
            else None
        )
        self.draft_model = None
        if config.draft_model is not None:  # method draft (the schema asks for both together)
            # imported here: only this method loads a second model
            from pagedserve.engine.spec_decode.draft_model import DraftModelProposer

            self.draft_model = DraftModelProposer(
                config.draft_model,
                k,
                runner.dtype,
                str(runner.device),
                runner.block_size,
                runner.num_blocks,
                max_model_len,
                runner.vocab_size,
            )
        self.suffix = (
            None
            if config.method in (SpecMethod.NGRAM, SpecMethod.DRAFT)
            else SuffixProposer(
                k,
                config.suffix_max_depth,
                config.suffix_global_tokens,
                config.suffix_min_prob,
                config.suffix_spec_factor,
            )
        )
        self.adaptive = AdaptiveSpeculation(k) if config.method is SpecMethod.AUTO else None

    def observe(self, so: SchedulerOutput, result: ModelRunnerOutput, seconds: float) -> None:
        """After a step: its time (decode-only steps feed the cost model) and each drafted
        request's kept count. Call before the scheduler consumes `result`."""
        if self.adaptive is None:
            return
        spec = so.scheduled_spec_tokens
        for req_id, drafts in spec.items():
            tokens = result.sampled_token_ids.get(req_id)
            if tokens:
                self.adaptive.observe_verification(req_id, len(drafts), len(tokens) - 1)
        num_drafts = sum(len(d) for d in spec.values())
        decode_only = (
            not so.new_requests
            and len(so.num_scheduled_tokens) > 0
            and all(n == 1 + len(spec.get(r, ())) for r, n in so.num_scheduled_tokens.items())
        )
        if decode_only:
            self.adaptive.observe_step(len(so.num_scheduled_tokens), num_drafts, seconds)

    def draft(self, running: list[Request], live_ids: Iterable[str]) -> None:
        """Set the next step's drafts of the running requests that are decoding (never a
        pooling request: it samples nothing); forget requests no longer in `live_ids`."""
        self._release(live_ids)
        decoding = [
            r
            for r in running
            if r.num_computed_tokens == r.num_tokens - 1 and r.pooling_params is None and can_draft(r.sampling_params)
        ]
        batch: list[tuple[Request, int]] = []  # draft model: (request, room), drafted together
        probed = False  # auto: one 1-token probe per step at most
        for request in decoding:
            params = request.sampling_params
            # Kept drafts plus the target's own token must fit max_tokens and max_model_len.
            room = self.max_model_len - request.num_tokens - 1
            if params.max_tokens is not None:
                room = min(room, params.max_tokens - request.num_output_tokens - 1)
            if self.draft_model is not None:
                batch.append((request, room))
                continue
            if self.suffix is None:
                assert self.ngram is not None  # method ngram: the one proposer
                request.spec_token_ids = self.ngram.propose(request.all_token_ids, room)
                continue
            assert self.suffix is not None  # suffix and auto: the one proposer left
            lookup = None
            if self.adaptive is not None:
                k = self.adaptive.num_drafts(request.request_id, len(decoding), may_probe=not probed)
                probed |= self.adaptive.probed
                room = min(room, k)
                lookup = None if self.adaptive.proven(request.request_id) else self.ngram
                if room <= 0:  # nothing proposed: nothing indexed, nothing to pay
                    request.spec_token_ids = []
                    self.adaptive.record_choice(0)
                    continue
            self.suffix.update(
                request.request_id, request.all_token_ids, request.num_prompt_tokens, request.lora_id or ""
            )
            request.spec_token_ids = self.suffix.propose(request.request_id, room, lookup).tokens
            if self.adaptive is not None:
                self.adaptive.observe_proposal(request.request_id, bool(request.spec_token_ids))
                self.adaptive.record_choice(len(request.spec_token_ids))
        if batch and self.draft_model is not None:
            drafts = self.draft_model.propose([(r.request_id, r.all_token_ids, room) for r, room in batch])
            for request, _ in batch:
                request.spec_token_ids = drafts.get(request.request_id, [])
        for request in decoding:  # a constrained request verifies only drafts its grammar allows
            if request.grammar is not None and request.spec_token_ids:
                request.spec_token_ids = request.spec_token_ids[: request.grammar.valid_prefix(request.spec_token_ids)]

    def stats(self) -> dict:
        """SchedulerStats fields of speculation (pagedserve.engine.scheduler.stats)."""
        out: dict[str, Any] = {}
        if self.adaptive is not None:
            a = self.adaptive.stats
            out.update(
                spec_requests_drafted=a.requests_drafted,
                spec_requests_skipped=a.requests_skipped,
                spec_acceptance_rate=a.acceptance_rate,
                spec_cost_ratio=a.cost_ratio,
            )
        if self.suffix is not None:
            s = self.suffix.stats()
            out.update(spec_suffix_global_tokens=s.global_tokens, spec_suffix_global_bytes=s.global_bytes)
        return out

    def _release(self, live_ids: Iterable[str]) -> None:
        live = set(live_ids)
        if self.draft_model is not None:
            self.draft_model.release([r for r in self.draft_model.live_requests() if r not in live])
        if self.suffix is None:
            return
        self.suffix.release([r for r in self.suffix.live_requests() if r not in live])
        if self.adaptive is not None:  # also the requests never indexed (never drafted)
            for req_id in [r for r in self.adaptive.live_requests() if r not in live]:
                self.adaptive.forget(req_id)
