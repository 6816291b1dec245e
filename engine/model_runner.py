"""The model runner: turns a SchedulerOutput into one flattened batch, runs the model, samples."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.attention.kv_quant import parse_kv_cache_dtype
from engine.attention.metadata import AttentionMetadata
from engine.attention.selector import select_backend
from engine.config import EngineConfig
from engine.logits_processors import apply_logit_bias
from engine.lora.adapter import LoRAAdapter
from engine.lora.manager import LoRAManager, lora_shapes
from engine.model.compile import compile_buckets, compiled_forward_for
from engine.model.loader import (
    allocate_kv_caches,
    kv_pool_size,
    load_model,
    select_fused_ops,
)
from engine.model.quant_spec import resolve_spec
from engine.pooling import PoolingParams, pool_last_token
from engine.sampler import Sampler, processed_probs
from engine.sampling_metadata import SamplingMetadata
from engine.sampling_params import SamplingParams, SamplingType
from engine.scheduler.output import Logprobs, ModelRunnerOutput, SchedulerOutput
from engine.spec_decode.rejection import rejection_sample, verify_greedy
from engine.structured_output import apply_bitmask

if TYPE_CHECKING:
    from engine.parallel.driver import TensorParallelModel


@dataclass(slots=True)
class CachedRequestState:
    """What the runner remembers of a running request between steps."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    pooling_params: PoolingParams | None = None
    lora: LoRAAdapter | None = None
    output_token_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.output_token_ids = self.token_ids[self.num_prompt_tokens :]


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_dir: str, hf_config: dict, eos_token_ids: frozenset[int], max_model_len: int
    ) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.vocab_size = int(hf_config["vocab_size"])
        self.eos_token_ids = eos_token_ids
        self.kv_dtype = parse_kv_cache_dtype(config.kv_cache_dtype)
        self.backend = select_backend(self.device, config.attention_backend, self.kv_dtype)
        quant = resolve_spec(hf_config, config.quantization, config.quant_group_size, config.device)
        buckets = compile_buckets(config, self.dtype, self.device)
        # Tensor parallelism (engine.parallel): this process is rank 0 and drives the others.
        self.tp: TensorParallelModel | None = None
        if config.tensor_parallel_size > 1:
            # imported here: it imports torch.distributed, which a single-process worker never needs
            from engine.parallel.driver import LoRAUnsupported, TensorParallelModel

            self.model = self.tp = TensorParallelModel(config, model_dir, self.backend, max_model_len, quant)
        else:
            self.model = load_model(
                model_dir, self.dtype, self.device, self.backend,
                max_model_len=max_model_len, fused_ops=select_fused_ops(self.device, self.dtype), quant=quant,
                pack_linear=not buckets,
            )
        # The KV heads of this process (a tensor-parallel rank's share); the budget is the worker's.
        self.bytes_per_block, self.num_blocks = kv_pool_size(config, self.model.rank_spec, self.kv_dtype)
        self.kv_caches = allocate_kv_caches(self.model.rank_spec, self.num_blocks, self.block_size, self.dtype,
                                            self.device, self.kv_dtype)
        # torch.compile'd forward for the steps it covers (config.compile), compiled here, before ready.
        self.compiled = compiled_forward_for(config, self.model, self.backend, self.kv_caches, buckets)
        self.sampler = Sampler()
        # LoRA adapters: read on first use, at most max_loras resident (slots allocated lazily).
        self.lora = LoRAManager(lora_shapes(self.model.spec), config.max_loras, config.max_lora_rank,
                                self.dtype, self.device) if self.tp is None else LoRAUnsupported(self.tp.size)
        self.requests: dict[str, CachedRequestState] = {}
        self.generators: dict[str, torch.Generator] = {}  # seeded requests, until they finish

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks this runner started (none without). Idempotent."""
        if self.tp is not None:
            self.tp.close()

    # -- state -----------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self.generators.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            # A preempted request comes back as new; its generator keeps its state, so a seeded
            # request samples the same tokens whether or not it was preempted.
            self.requests.pop(req_id, None)
        for new in so.new_requests:
            params = new.sampling_params
            generator = self.generators.get(new.req_id)
            if generator is None and params.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
                self.generators[new.req_id] = generator
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, params,
                list(new.block_ids), new.num_computed_tokens, generator,
                pooling_params=new.pooling_params,
                lora=None if new.lora is None else self.lora.load(new.lora),
            )
        for cached in so.cached_requests:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # -- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput({})
        # Decodes first: the attention backend batches rows [0, num_decodes) together.
        order = sorted(so.num_scheduled_tokens, key=lambda r: so.num_scheduled_tokens[r] != 1)
        batch = self._prepare_inputs(order, so.num_scheduled_tokens, so.scheduled_spec_tokens)
        input_ids, positions, meta, sample_rows, sample_ids, spec_ids = batch
        lora = self.lora.build_batch([self.requests[r].lora for r in order],
                                     [so.num_scheduled_tokens[r] for r in order])
        compiled = self.compiled is not None and self.compiled.covers(len(input_ids), lora)
        hidden = (self.compiled if compiled else self.model)(input_ids, positions, self.kv_caches, meta, lora)
        result = ModelRunnerOutput({})
        if any(self.requests[r].pooling_params is not None for r in sample_ids):
            sample_rows, sample_ids = self._pool(hidden, sample_rows, sample_ids, result)
        if not sample_ids and not spec_ids:
            return result
        logits = self.model.compute_logits(hidden[sample_rows])
        if spec_ids:
            # Rows [len(sample_ids), ...): k + 1 rows per drafted request, in spec_ids order.
            self._verify_drafts(logits[len(sample_ids):], spec_ids, so.scheduled_spec_tokens, result)
            logits = logits[: len(sample_ids)]
        if not sample_ids:
            return result
        if so.grammar_bitmask is not None:
            constrained = [(i, so.grammar_rows[r]) for i, r in enumerate(sample_ids) if r in so.grammar_rows]
            if constrained:
                apply_bitmask(logits, so.grammar_bitmask[[row for _, row in constrained]], [i for i, _ in constrained])
        states = [self.requests[r] for r in sample_ids]
        sampling_meta = SamplingMetadata.build(
            [s.sampling_params for s in states],
            [s.token_ids[: s.num_prompt_tokens] for s in states],
            [s.output_token_ids for s in states],
            [s.generator for s in states],
            self.eos_token_ids,
            self.vocab_size,
            self.device,
        )
        out = self.sampler(logits, sampling_meta)
        sampled = out.sampled_token_ids.tolist()
        for state, token in zip(states, sampled):
            state.token_ids.append(token)
            state.output_token_ids.append(token)
            result.sampled_token_ids[state.req_id] = [token]
        if out.logprobs is not None:
            ids = out.logprobs.token_ids.tolist()
            lps = out.logprobs.logprobs.tolist()
            ranks = out.logprobs.sampled_ranks.tolist()
            for row, state in enumerate(states):
                k = state.sampling_params.logprobs
                if k is not None:
                    result.logprobs[state.req_id] = [Logprobs(ids[row][: k + 1], lps[row][: k + 1], ranks[row])]
        return result

    def _pool(self, hidden: torch.Tensor, rows: torch.Tensor, req_ids: list[str],
              result: ModelRunnerOutput) -> tuple[torch.Tensor, list[str]]:
        """Pool the last prompt row of each pooling request among `req_ids` into `result`;
        returns the rows and ids left to sample (the spec rows after them unchanged)."""
        pooling = [i for i, r in enumerate(req_ids) if self.requests[r].pooling_params is not None]
        vectors = pool_last_token(hidden[rows[pooling]], [self.requests[req_ids[i]].pooling_params for i in pooling])
        for i, vector in zip(pooling, vectors):
            result.pooled[req_ids[i]] = vector
        keep = [i for i in range(len(rows)) if i >= len(req_ids) or self.requests[req_ids[i]].pooling_params is None]
        return rows[keep], [req_ids[i] for i in keep if i < len(req_ids)]

    def _verify_drafts(self, logits: torch.Tensor, spec_ids: list[str], drafts: dict[str, list[int]],
                       result: ModelRunnerOutput) -> None:
        """Keep what the target model agrees with of each request's drafts, plus one token of its own."""
        argmax = logits.max(dim=-1).indices.tolist()  # one call for every greedy row
        row = 0
        for req_id in spec_ids:
            state = self.requests[req_id]
            k = len(drafts[req_id])
            rows = logits[row : row + k + 1]
            params = state.sampling_params
            if params.logit_bias:  # the draft is checked against the biased distribution
                rows = apply_logit_bias(rows, dict.fromkeys(range(k + 1), params.logit_bias))
            if params.sampling_type is SamplingType.GREEDY:
                greedy = rows.max(dim=-1).indices.tolist() if params.logit_bias else argmax[row : row + k + 1]
                tokens = verify_greedy(greedy, drafts[req_id])
            else:
                meta = SamplingMetadata.build([params] * (k + 1), [()] * (k + 1), [()] * (k + 1),
                                              [None] * (k + 1), self.eos_token_ids, self.vocab_size, self.device)
                tokens = rejection_sample(processed_probs(rows.float(), meta), drafts[req_id], state.generator)
            row += k + 1
            state.token_ids.extend(tokens)
            state.output_token_ids.extend(tokens)
            result.sampled_token_ids[req_id] = tokens

    def _prepare_inputs(self, order: list[str], num_scheduled: dict[str, int], spec: dict[str, list[int]]):
        """Flattened inputs of the step. Rows to sample: the last row of every request that
        reaches its newest token (`sample_ids`, in order), then the k + 1 last rows of every
        request with k drafts scheduled (`spec_ids`)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        spec_rows: list[int] = []
        spec_ids: list[str] = []
        max_blocks = 0
        for req_id in order:
            state = self.requests[req_id]
            n = num_scheduled[req_id]
            start = state.num_computed_tokens
            end = start + n
            drafts = spec.get(req_id)
            if drafts:  # the newest known token, then the drafts after it
                if end != len(state.token_ids) + len(drafts):
                    raise RuntimeError(f"{req_id}: {n} tokens scheduled from {start} do not end at its drafts")
                input_ids.extend(state.token_ids[start:] + drafts)
                spec_rows.extend(range(len(input_ids) - len(drafts) - 1, len(input_ids)))
                spec_ids.append(req_id)
            else:
                input_ids.extend(state.token_ids[start:end])
                if end == len(state.token_ids):  # reached the newest token: sample the next one
                    sample_rows.append(len(input_ids) - 1)
                    sample_ids.append(req_id)
            positions.extend(range(start, end))
            blocks = state.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            seq_lens.append(end)
            max_blocks = max(max_blocks, len(blocks))
        block_tables = torch.tensor(
            [b + [0] * (max_blocks - len(b)) for b in (self.requests[r].block_ids for r in order)],
            dtype=torch.int32,
        )
        query_start = [0]
        for q in query_lens:
            query_start.append(query_start[-1] + q)
        dev = self.device
        meta = AttentionMetadata(
            num_seqs=len(order),
            num_tokens=len(input_ids),
            query_lens=query_lens,
            seq_lens=seq_lens,
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            num_decodes=sum(1 for q in query_lens if q == 1),
        )
        return (
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            meta,
            torch.tensor(sample_rows + spec_rows, dtype=torch.int64, device=dev),
            sample_ids,
            spec_ids,
        )
