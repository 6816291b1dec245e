"""The model runner: turns a SchedulerOutput into one flattened batch, runs the model, samples."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from pagedserve.engine.attention.kv_dtype import parse_kv_cache_dtype
from pagedserve.engine.attention.metadata import AttentionMetadata
from pagedserve.engine.attention.selector import backend_for_layer, select_backend
from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.lora.adapter import LoRAAdapter, lora_shapes
from pagedserve.engine.lora.manager import LoRAManager, LoRAUnsupported
from pagedserve.engine.lora.punica import LoRABatch
from pagedserve.engine.model.causal_lm import CausalLM
from pagedserve.engine.model.compile import compile_buckets, compiled_forward_for
from pagedserve.engine.model.kv_pool_size import kv_layout, kv_pool_size
from pagedserve.engine.model.layers.batch_invariant import make_batch_invariant
from pagedserve.engine.model.loader import allocate_kv_caches, load_model, select_fused_ops
from pagedserve.engine.model.quant_spec import resolve_spec
from pagedserve.engine.request.pooling import PoolingParams, pool_last_token
from pagedserve.engine.runner.input_batch import InputBatch, StepInputs
from pagedserve.engine.sampling.logits_processors import apply_logit_bias
from pagedserve.engine.sampling.metadata import SamplingMetadata
from pagedserve.engine.sampling.params import SamplingParams, SamplingType
from pagedserve.engine.sampling.sampler import Sampler, processed_probs
from pagedserve.engine.scheduler.output import Logprobs, ModelRunnerOutput, SchedulerOutput
from pagedserve.engine.spec_decode.draft_model import draft_kv_bytes_per_block
from pagedserve.engine.spec_decode.rejection import rejection_sample, verify_greedy
from pagedserve.engine.structured_output.manager import apply_bitmask

if TYPE_CHECKING:
    from pagedserve.engine.model.layers.decoder import DecoderLayer
    from pagedserve.engine.parallel.driver import TensorParallelModel


@dataclass(slots=True)
class CachedRequestState:
    """What the runner remembers of a running request between steps, besides its row of the
    input batch (tokens, computed count, block table)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # known output tokens: for penalties and min_tokens
    sampling_params: SamplingParams
    generator: torch.Generator | None = None
    pooling_params: PoolingParams | None = None
    lora: LoRAAdapter | None = None


@dataclass(slots=True)
class PreparedStep:
    """One step's batch, ready to run once its input ids are gathered (`ModelRunner.launch`).

    Rows to sample: the last row of every request that reaches its newest token (`sample_ids`,
    in order), then the k + 1 last rows of every request with k drafts scheduled (`spec_ids`).
    The states are captured here so that running the step never looks up the runner's tables
    (async scheduling changes them for the next step meanwhile)."""

    so: SchedulerOutput
    inputs: StepInputs
    meta: AttentionMetadata | list[AttentionMetadata]  # one per layer with a hybrid KV cache
    positions: torch.Tensor
    sample_rows: torch.Tensor
    sample_ids: list[str]
    spec_ids: list[str]
    states: dict[str, CachedRequestState]  # every scheduled request's
    lora: LoRABatch | None
    input_ids: torch.Tensor | None = None


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
        self.backend = select_backend(
            self.device, config.attention_backend, self.kv_dtype, batch_invariant=config.batch_invariant
        )
        quant = resolve_spec(hf_config, config.quantization, config.quant_group_size, config.device)
        buckets = compile_buckets(config, self.dtype, self.device)
        # Tensor parallelism (pagedserve.engine.parallel): this process is rank 0 and drives the others.
        self.tp: TensorParallelModel | None = None
        self.model: CausalLM | TensorParallelModel
        if config.tensor_parallel_size > 1:
            # imported here: it imports torch.distributed, which a single-process worker never needs
            from pagedserve.engine.parallel.driver import TensorParallelModel

            self.model = self.tp = TensorParallelModel(config, model_dir, self.backend, max_model_len, quant)
        else:
            self.model = load_model(
                model_dir,
                self.dtype,
                self.device,
                self.backend,
                max_model_len=max_model_len,
                fused_ops=select_fused_ops(self.device, self.dtype),
                quant=quant,
                pack_linear=not buckets and not config.batch_invariant,
            )
            if config.batch_invariant:
                make_batch_invariant(self.model)
                self.model.fused_decode = None  # its reduction order is its own: one path for every row
        if self.tp is None:
            self._choose_layer_backends()
        # KV cache groups (one unless the model mixes attention kinds: the hybrid KV cache).
        self.kv_layout = kv_layout(config, self.model.rank_spec)
        self._group_of_layer = self.kv_layout.group_of_layer()
        # The KV heads of this process (a tensor-parallel rank's share); the budget is the worker's.
        self.bytes_per_block, self.num_blocks = kv_pool_size(config, self.model.rank_spec, self.kv_dtype)
        # A draft model (speculative method "draft") has a pool of as many blocks of its own:
        # the budget pays for both.
        spec = config.speculative_config
        self.draft_bytes_per_block = (
            0
            if spec is None or spec.draft_model is None
            else draft_kv_bytes_per_block(spec.draft_model, self.block_size, self.dtype)
        )
        if self.draft_bytes_per_block:
            self.num_blocks = config.resolve_num_blocks(self.bytes_per_block + self.draft_bytes_per_block)
        self.kv_caches = allocate_kv_caches(
            self.model.rank_spec,
            self.num_blocks,
            self.block_size,
            self.dtype,
            self.device,
            self.kv_dtype,
            self.kv_layout,
        )
        # torch.compile'd forward for the steps it covers (config.compile), compiled here, before ready.
        # (A tensor-parallel model stays eager: compile_buckets gave it no bucket.)
        self.compiled = (
            compiled_forward_for(config, self.model, self.backend, self.kv_caches, buckets)
            if isinstance(self.model, CausalLM)
            else None
        )
        self.sampler = Sampler()
        # LoRA adapters: read on first use, at most max_loras resident (slots allocated lazily).
        self.lora = self._lora_manager(config)
        self.requests: dict[str, CachedRequestState] = {}
        self.generators: dict[str, torch.Generator] = {}  # seeded requests, until they finish
        self.input_batch = InputBatch(
            config.max_num_seqs,
            max_model_len,
            config.max_num_batched_tokens,
            self.block_size,
            len(self.kv_layout.groups),
        )
        # Requests whose token the step launched last is sampling (async scheduling: it runs
        # while the next step is prepared, so that token is not in the batch yet).
        self._pending: set[str] = set()

    def _choose_layer_backends(self) -> None:
        """The attention backend per attention kind: sliding-window and soft-capped layers on
        the torch backend where the configured one cannot serve them (Triton)."""
        plain = functools.cache(lambda: select_backend(self.device, "torch", self.kv_dtype))
        for layer in cast("Iterable[DecoderLayer]", self.model.model.layers):
            attn = layer.self_attn
            attn.backend = backend_for_layer(attn.backend, attn.window, attn.softcap, plain)

    def _lora_manager(self, config: EngineConfig) -> LoRAManager | LoRAUnsupported:
        """The adapters' manager, or a refusal where adapters cannot run: tensor-parallel workers,
        and mixture-of-experts models (their experts take no adapter)."""
        if self.tp is not None:
            from pagedserve.engine.parallel.driver import lora_refusal

            return LoRAUnsupported(lora_refusal(self.tp.size))
        if self.model.spec.moe is not None:
            return LoRAUnsupported(
                f"lora: LoRA adapters are not supported for mixture-of-experts models ({self.model.spec.architecture})"
            )
        return LoRAManager(
            lora_shapes(self.model.spec), config.max_loras, config.max_lora_rank, self.dtype, self.device
        )

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks this runner started (none without). Idempotent."""
        if self.tp is not None:
            self.tp.close()

    # -- state -----------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        """Apply the scheduler's diffs to the states and the input batch's rows."""
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self.generators.pop(req_id, None)
            batch.remove_request(req_id)
        for req_id in so.preempted_req_ids:
            # A preempted request comes back as new; its generator keeps its state, so a seeded
            # request samples the same tokens whether or not it was preempted.
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
        for new in so.new_requests:
            params = new.sampling_params
            generator = self.generators.get(new.req_id)
            if generator is None and params.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
                self.generators[new.req_id] = generator
            self.requests[new.req_id] = CachedRequestState(
                new.req_id,
                new.token_ids[: new.num_prompt_tokens],
                new.token_ids[new.num_prompt_tokens :],
                params,
                generator,
                pooling_params=new.pooling_params,
                lora=None if new.lora is None else self.lora.load(new.lora),
            )
            batch.add_request(new.req_id, new.token_ids, new.num_computed_tokens, new.block_ids)
        for cached in so.cached_requests:
            row = batch.req_index[cached.req_id]
            if any(cached.new_block_ids):
                batch.append_blocks(row, cached.new_block_ids)
            batch.num_computed_tokens[row] = cached.num_computed_tokens

    # -- one step --------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One synchronous step: prepare, run, record the sampled tokens."""
        step = self.prepare_step(so)
        if step is None:
            return ModelRunnerOutput({})
        result = self.run_step(self.launch(step))
        self.record(step, result)
        return result

    def prepare_step(self, so: SchedulerOutput) -> PreparedStep | None:
        """Apply the scheduler's diffs and build the step's batch (None when nothing is
        scheduled). With a step still running (async scheduling), its sampled tokens are not
        known yet: `launch` gathers the input ids after `record` has added them."""
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return None
        return self._prepare_inputs(so)

    def launch(self, step: PreparedStep) -> PreparedStep:
        """Gather the step's input ids (every token it reads is known now); the step's sampled
        tokens are pending until `record`."""
        step.input_ids = self.input_batch.gather_input_ids(step.inputs).to(self.device)
        self._pending = set(step.sample_ids)
        return step

    @torch.inference_mode()
    def run_step(self, step: PreparedStep) -> ModelRunnerOutput:
        """Forward, logits, sampling. Touches only `step` and the model (async scheduling runs
        it on another thread while the next step is prepared)."""
        so, sample_rows, sample_ids, spec_ids = step.so, step.sample_rows, step.sample_ids, step.spec_ids
        input_ids = step.input_ids
        assert input_ids is not None, "launch() gathers the step's input ids first"
        forward: Callable[..., torch.Tensor] = self.model
        if self.compiled is not None and self.compiled.covers(len(input_ids), step.lora):
            forward = self.compiled
        hidden = forward(input_ids, step.positions, self.kv_caches, step.meta, step.lora)
        result = ModelRunnerOutput({})
        if any(step.states[r].pooling_params is not None for r in sample_ids):
            sample_rows, sample_ids = self._pool(hidden, step, result)
        if not sample_ids and not spec_ids:
            return result
        logits = self.model.compute_logits(hidden[sample_rows])
        assert logits is not None  # this process is rank 0, which gets every logit
        if spec_ids:
            # Rows [len(sample_ids), ...): k + 1 rows per drafted request, in spec_ids order.
            self._verify_drafts(logits[len(sample_ids) :], step, result)
            logits = logits[: len(sample_ids)]
        if not sample_ids:
            return result
        if so.grammar_bitmask is not None:
            constrained = [(i, so.grammar_rows[r]) for i, r in enumerate(sample_ids) if r in so.grammar_rows]
            if constrained:
                apply_bitmask(logits, so.grammar_bitmask[[row for _, row in constrained]], [i for i, _ in constrained])
        states = [step.states[r] for r in sample_ids]
        sampling_meta = SamplingMetadata.build(
            [s.sampling_params for s in states],
            [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states],
            [s.generator for s in states],
            self.eos_token_ids,
            self.vocab_size,
            self.device,
        )
        out = self.sampler(logits, sampling_meta)
        for req_id, token in zip(sample_ids, out.sampled_token_ids.tolist()):
            result.sampled_token_ids[req_id] = [token]
        if out.logprobs is not None:
            ids = out.logprobs.token_ids.tolist()
            lps = out.logprobs.logprobs.tolist()
            ranks = out.logprobs.sampled_ranks.tolist()
            for row, state in enumerate(states):
                k = state.sampling_params.logprobs
                if k is not None:
                    result.logprobs[state.req_id] = [Logprobs(ids[row][: k + 1], lps[row][: k + 1], ranks[row])]
        return result

    def record(self, step: PreparedStep, result: ModelRunnerOutput) -> None:
        """Add the step's sampled (and kept draft) tokens to the states and the batch rows. A
        request whose row is gone (finished, aborted or preempted since) keeps none."""
        batch = self.input_batch
        for req_id, tokens in result.sampled_token_ids.items():
            row = batch.req_index.get(req_id)
            if row is not None:
                step.states[req_id].output_token_ids.extend(tokens)
                batch.append_tokens(row, tokens)
        self._pending.clear()

    def _pool(
        self, hidden: torch.Tensor, step: PreparedStep, result: ModelRunnerOutput
    ) -> tuple[torch.Tensor, list[str]]:
        """Pool the last prompt row of each pooling request among the step's sampling requests
        into `result`; returns the rows and ids left to sample (the spec rows after them unchanged)."""
        rows, req_ids = step.sample_rows, step.sample_ids
        params = [step.states[r].pooling_params for r in req_ids]
        pooling = [i for i, p in enumerate(params) if p is not None]
        vectors = pool_last_token(hidden[rows[pooling]], [p for p in params if p is not None])
        for i, vector in zip(pooling, vectors):
            result.pooled[req_ids[i]] = vector
        keep = [i for i in range(len(rows)) if i >= len(req_ids) or params[i] is None]
        return rows[keep], [req_ids[i] for i in keep if i < len(req_ids)]

    def _verify_drafts(self, logits: torch.Tensor, step: PreparedStep, result: ModelRunnerOutput) -> None:
        """Keep what the target model agrees with of each request's drafts, plus one token of its own."""
        drafts = step.so.scheduled_spec_tokens
        argmax = logits.max(dim=-1).indices.tolist()  # one call for every greedy row
        row = 0
        for req_id in step.spec_ids:
            state = step.states[req_id]
            k = len(drafts[req_id])
            rows = logits[row : row + k + 1]
            params = state.sampling_params
            if params.logit_bias:  # the draft is checked against the biased distribution
                rows = apply_logit_bias(rows, dict.fromkeys(range(k + 1), params.logit_bias))
            bitmask = step.so.grammar_bitmask
            masked = bitmask is not None and req_id in step.so.grammar_rows
            if bitmask is not None and masked:  # and against the grammar, one mask row per position
                first = step.so.grammar_rows[req_id]
                rows = rows.clone()
                apply_bitmask(rows, bitmask[first : first + k + 1], list(range(k + 1)))
            if params.sampling_type is SamplingType.GREEDY:
                greedy = rows.max(dim=-1).indices.tolist() if params.logit_bias or masked else argmax[row : row + k + 1]
                tokens = verify_greedy(greedy, drafts[req_id])
            else:
                meta = SamplingMetadata.build(
                    [params] * (k + 1),
                    [()] * (k + 1),
                    [()] * (k + 1),
                    [None] * (k + 1),
                    self.eos_token_ids,
                    self.vocab_size,
                    self.device,
                )
                tokens = rejection_sample(processed_probs(rows.float(), meta), drafts[req_id], state.generator)
            row += k + 1
            result.sampled_token_ids[req_id] = tokens

    def _prepare_inputs(self, so: SchedulerOutput) -> PreparedStep:
        """The step's flattened inputs from the input batch (see PreparedStep for the rows to
        sample). Decodes come first: the attention backend batches rows [0, num_decodes)."""
        batch = self.input_batch
        req_ids = list(so.num_scheduled_tokens)
        num_scheduled = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        order = np.argsort(num_scheduled != 1, kind="stable")
        req_ids = [req_ids[i] for i in order]
        num_scheduled = num_scheduled[order]
        spec = so.scheduled_spec_tokens
        for req_id, drafts in spec.items():  # the drafts follow the newest known token
            batch.write_scratch(batch.req_index[req_id], drafts)
        inputs = batch.prepare(req_ids, num_scheduled)
        # Known tokens of each sequence, counting the one its previous step is still sampling.
        known = batch.num_tokens[inputs.rows]
        if self._pending:
            known = known + np.fromiter((r in self._pending for r in req_ids), dtype=np.int64, count=len(req_ids))
        ends = inputs.seq_lens.astype(np.int64)
        spec_ids = [r for r in req_ids if spec.get(r)]
        if spec_ids:
            is_spec = np.fromiter((bool(spec.get(r)) for r in req_ids), dtype=bool, count=len(req_ids))
            drafted = np.fromiter((len(spec.get(r) or ()) for r in req_ids), dtype=np.int64, count=len(req_ids))
            if np.any(ends[is_spec] != known[is_spec] + drafted[is_spec]):
                raise RuntimeError("tokens scheduled for a drafted request do not end at its drafts")
        else:
            is_spec = np.zeros(len(req_ids), dtype=bool)
        if np.any(ends[~is_spec] > known[~is_spec]):
            raise RuntimeError("a request is scheduled past its known tokens")
        samples = (ends == known) & ~is_spec
        cu = inputs.query_start_loc[1:].astype(np.int64)
        sample_rows = (cu[samples] - 1).tolist()
        spec_rows: list[int] = []
        for i in np.flatnonzero(is_spec).tolist():  # the newest known token, then the drafts
            k = len(spec[req_ids[i]])
            spec_rows.extend(range(int(cu[i]) - k - 1, int(cu[i])))
        query_lens = num_scheduled.tolist()
        seq_lens = inputs.seq_lens.tolist()
        dev = self.device
        query_start_loc = torch.from_numpy(inputs.query_start_loc).to(dev)
        seq_lens_tensor = torch.from_numpy(inputs.seq_lens).to(dev)
        metas = [
            AttentionMetadata(
                num_seqs=len(req_ids),
                num_tokens=inputs.num_tokens,
                query_lens=query_lens,
                seq_lens=seq_lens,
                query_start_loc=query_start_loc,
                seq_lens_tensor=seq_lens_tensor,
                block_tables=torch.from_numpy(tables).to(dev),
                slot_mapping=torch.from_numpy(slots).to(dev),
                max_query_len=max(query_lens),
                max_seq_len=max(seq_lens),
                num_decodes=int(np.count_nonzero(num_scheduled == 1)),
            )
            for tables, slots in zip(inputs.block_tables, inputs.slot_mapping)
        ]
        # A hybrid KV cache: each layer attends through its group's block tables.
        meta = metas[0] if len(metas) == 1 else [metas[g] for g in self._group_of_layer]
        states = {r: self.requests[r] for r in req_ids}
        lora = self.lora.build_batch([states[r].lora for r in req_ids], query_lens)
        return PreparedStep(
            so,
            inputs,
            meta,
            torch.from_numpy(inputs.positions).to(dev),
            torch.tensor(sample_rows + spec_rows, dtype=torch.int64, device=dev),
            [r for r, s in zip(req_ids, samples.tolist()) if s],
            spec_ids,
            states,
            lora,
        )
