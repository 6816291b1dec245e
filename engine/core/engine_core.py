"""EngineCore: scheduler + KV cache manager + model runner behind a pure, in-process step()."""

from __future__ import annotations

import gc
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.kv_cache.hashing import get_hash_fn
from pagedserve.engine.kv_cache.manager import KVCacheManager
from pagedserve.engine.model.model_source import resolve_model_dir
from pagedserve.engine.platform.process_setup import release_free_memory
from pagedserve.engine.request.inputs import InputLimits
from pagedserve.engine.request.request import FinishReason, Request, RequestStatus
from pagedserve.engine.runner.model_runner import ModelRunner, PreparedStep
from pagedserve.engine.scheduler.output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pagedserve.engine.scheduler.scheduler import Scheduler
from pagedserve.engine.scheduler.stats import SchedulerStats
from pagedserve.engine.spec_decode.speculator import Speculator
from pagedserve.engine.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.05  # an idle step waits this long for a grammar compile to finish


def read_eos_token_ids(model_dir: Path, hf_config: dict) -> frozenset[int]:
    """EOS ids from generation_config.json (preferred) or config.json; int or list."""
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    eos = gen.get("eos_token_id", hf_config.get("eos_token_id"))
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


class EngineCore:
    """One engine: requests in, per-step outputs out. No sockets and no process-wide settings
    (torch threads, seed, malloc): the process's owner applies those with
    `pagedserve.engine.platform.process_setup.configure_engine_process` before it builds the engine.

    With `async_scheduling` on, one thread of its own runs each step's forward and sampling
    while the calling thread schedules and prepares the next step and then hands back the
    finished step's outputs (see `step`). Off (the default), everything runs in the caller.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = Path(config.model) if config.model_verified else resolve_model_dir(config.model)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"{model_dir} is not a model directory (no config.json)")
        self.model_dir = model_dir
        self.hf_config = json.loads((model_dir / "config.json").read_text())
        self.vocab_size = int(self.hf_config["vocab_size"])
        self.max_model_len = config.resolve_max_model_len(int(self.hf_config.get("max_position_embeddings", 2048)))
        self.eos_token_ids = read_eos_token_ids(model_dir, self.hf_config)
        self.sleeping = False
        self._runner: ModelRunner | None = ModelRunner(
            config, str(model_dir), self.hf_config, self.eos_token_ids, self.max_model_len
        )
        # Loading leaves its temporaries (float32 shards, quantization's work tensors) in malloc's
        # free lists, which tune_glibc_malloc keeps from being trimmed: return them now, or the
        # worker keeps them resident for its whole life (measured: +95 MiB for int4).
        release_free_memory()
        # A request alone must always fit the pool, or it would wait forever (with a hybrid KV
        # cache it holds blocks in every group: all of a full group's, a window's of a sliding one).
        layout = self.runner.kv_layout
        chunk = config.max_num_batched_tokens
        pool_tokens = layout.longest_sequence(self.runner.num_blocks, config.block_size, chunk, self.max_model_len)
        if pool_tokens < self.max_model_len:
            if config.max_model_len is not None:
                raise ValueError(
                    f"max_model_len={config.max_model_len} does not fit the KV pool "
                    f"({self.runner.num_blocks} blocks of {config.block_size} tokens hold one sequence of "
                    f"{pool_tokens} tokens): raise kv_cache_memory / num_kv_blocks or lower max_model_len"
                )
            logger.warning("max_model_len lowered to %d to fit the KV pool", pool_tokens)
            self.max_model_len = pool_tokens
        # The engine lets max_tokens run past max_model_len (it ends with "length"); the server
        # refuses such requests up front.
        self.input_limits = InputLimits(self.max_model_len, self.vocab_size, max_tokens_must_fit=False)
        self.kv_manager = self._new_kv_manager()
        self.kv_offload = None
        if config.kv_offload_config is not None:
            # Imported here: it imports LMCache (seconds, ~120 MB), needed only with offload on.
            from pagedserve.engine.kv_offload.keys import model_fingerprint
            from pagedserve.engine.kv_offload.manager import KVOffloadManager

            self.kv_offload = KVOffloadManager(
                config.kv_offload_config,
                self.runner.kv_caches,
                config.block_size,
                model_fingerprint(model_dir, config.torch_dtype, config.kv_cache_dtype),
            )
        self.structured_output = StructuredOutputManager(str(model_dir), self.vocab_size, self.eos_token_ids)
        self._compiling: dict[str, Request] = {}  # requests whose grammar is not ready yet
        spec = config.speculative_config
        self.drafter = None if spec is None else Speculator(spec, self.max_model_len, self.runner)
        # Async scheduling: drafts depend on the previous step's tokens, the offload tiers store
        # what a step computed, and tensor-parallel ranks are driven from the engine's thread:
        # with any of them the engine stays synchronous.
        self.async_scheduling = (
            config.async_scheduling and self.drafter is None and self.kv_offload is None and self.runner.tp is None
        )
        if config.async_scheduling and not self.async_scheduling:
            logger.info(
                "async_scheduling is off: speculative decoding, KV offload and tensor parallelism run synchronously"
            )
        self._forward_thread = (
            ThreadPoolExecutor(1, thread_name_prefix="engine-forward") if self.async_scheduling else None
        )
        self._in_flight: tuple[SchedulerOutput, PreparedStep, Future[ModelRunnerOutput]] | None = None
        # Unfinished requests that make a step synchronous (grammar, LoRA adapter, pooling).
        self._sync_only: set[str] = set()
        # Disaggregated prefill: requests whose KV must have landed in the shared tiers before
        # their finished output leaves (pagedserve.server.workers.disagg).
        self._producers: set[str] = set()
        self.scheduler = self._new_scheduler()

    def _new_kv_manager(self) -> KVCacheManager:
        return KVCacheManager(
            self.runner.num_blocks,
            self.config.block_size,
            get_hash_fn(self.config.prefix_cache_hash),
            self.config.enable_prefix_caching,
            self.runner.kv_layout.groups,
        )

    def _new_scheduler(self) -> Scheduler:
        config = self.config
        return Scheduler(
            self.kv_manager,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            self.max_model_len,
            config.scheduling_policy,
            kv_offload=self.kv_offload,
            max_loras=config.max_loras,
            async_scheduling=self.async_scheduling,
        )

    # -- sleep and wake --------------------------------------------------------------------
    def sleep(self) -> None:
        """Free the weights and the KV pool, keeping everything else (imports, compiled
        kernels, the tokenizer-side grammar cache). RuntimeError while requests are unfinished
        or with KV offload on (its connector holds the pool). Idempotent. The caller returns
        the freed heap to the system (`pagedserve.engine.platform.process_setup.release_free_memory`)."""
        if self.sleeping:
            return
        if not self.scheduler.has_unfinished_requests():
            self._finish_in_flight()  # a step that only computed dropped tokens
        if self.has_unfinished_requests():
            raise RuntimeError("the worker has unfinished requests; it sleeps only when idle")
        if self.kv_offload is not None:
            raise RuntimeError("a worker with KV offload on cannot sleep")
        self.runner.shutdown()  # tensor-parallel ranks exit: wake starts them again
        self._runner = None  # the model's parameters and the KV tensors go with it
        self.sleeping = True
        if torch.device(self.config.device).type == "cuda":
            # Off the device for real: torch's caching allocator keeps freed blocks reserved
            # (other processes could not use them) until it is told to give them back.
            gc.collect()
            torch.cuda.empty_cache()

    @property
    def runner(self) -> ModelRunner:
        """The model runner (a sleeping worker has none: its weights and KV pool are freed)."""
        if self._runner is None:
            raise RuntimeError("the worker is asleep")
        return self._runner

    def wake(self) -> None:
        """Load the weights again from the model directory (the page cache keeps them warm)
        and allocate a fresh KV pool; the prefix cache starts empty (its blocks are gone)."""
        if not self.sleeping:
            return
        self._runner = ModelRunner(
            self.config, str(self.model_dir), self.hf_config, self.eos_token_ids, self.max_model_len
        )
        self.kv_manager = self._new_kv_manager()
        self.scheduler = self._new_scheduler()
        self.sleeping = False

    def add_request(self, request: Request) -> None:
        if self.sleeping:
            raise ValueError("the worker is asleep: wake it first")
        if request.lora is not None:  # read the adapter now: a bad one refuses the request
            request.lora_id = self.runner.lora.load(request.lora).key
        request.eos_token_ids = self.eos_token_ids
        self.scheduler.add_request(request)
        if (
            request.sampling_params.structured_outputs is not None
            or request.lora is not None
            or request.pooling_params is not None
        ):
            self._sync_only.add(request.request_id)
        if request.kv_produce and self.kv_offload is not None:
            self._producers.add(request.request_id)
        self.structured_output.add_request(request)
        if request.grammar is not None:
            self._compiling[request.request_id] = request

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.finish_requests(request_ids, status)
        self._producers.difference_update(request_ids)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished yet, or (async scheduling) a step whose outputs are not out."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def shutdown(self) -> None:
        """Release what the engine holds beyond its own memory (threads, files, processes): the
        async-scheduling thread ends, the KV offload tier finishes its queued disk writes and
        LMCache is destroyed; tensor-parallel ranks exit. Idempotent."""
        if self._forward_thread is not None:
            self._in_flight = None
            self._forward_thread.shutdown(wait=True)
        if self.kv_offload is not None:
            self.kv_offload.close()
        if self._runner is not None:
            self._runner.shutdown()
        self.structured_output.shutdown()

    def kv_offload_stats(self) -> dict | None:
        """KV offload counters (pagedserve.engine.kv_offload.stats.KVOffloadStats as a dict), None if off."""
        return None if self.kv_offload is None else self.kv_offload.get_stats()

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_manager
        return SchedulerStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=kv.pool.num_blocks,
            num_free_blocks=kv.pool.get_num_free_blocks(),
            prefix_cache_queries=kv.num_queried_tokens,
            prefix_cache_hits=kv.num_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_threads=torch.get_num_threads(),
            spec_draft_tokens=self.scheduler.num_draft_tokens,
            spec_accepted_tokens=self.scheduler.num_accepted_tokens,
            kv_offload=self.kv_offload_stats(),
            **(self.drafter.stats() if self.drafter is not None else {}),
        )

    def set_num_threads(self, n: int) -> None:
        """Torch intra-op threads for the following steps (shared among tensor-parallel ranks)."""
        if self._runner is not None and self._runner.tp is not None:
            self._runner.tp.set_num_threads(n)
        else:
            torch.set_num_threads(n)
        if self._forward_thread is not None:  # a thread reads torch's setting once: tell it too
            self._forward_thread.submit(torch.set_num_threads, n)

    def check_health(self) -> None:
        """Raise (TensorParallelError) when a part of the engine outside this process, a
        tensor-parallel rank, is gone: the engine cannot step any more."""
        if self._runner is not None and self._runner.tp is not None:
            self._runner.tp.check_health()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, execute, update. Returns the news of every request that got a token, and
        of every request whose grammar failed to compile.

        With async scheduling a step instead schedules and prepares step k+1 while step k runs,
        launches k+1 as soon as k is done and returns k's news (so the caller's output
        processing overlaps k+1 too). A step whose requests include one with a grammar, a LoRA
        adapter or pooling params runs synchronously, after the step in flight."""
        if self.async_scheduling and not self._needs_sync():
            return self._step_async()
        return self._finish_in_flight() + self._step_sync()

    def _needs_sync(self) -> bool:
        if self._sync_only:
            self._sync_only = {r for r in self._sync_only if r in self.scheduler.requests}
        return bool(self._sync_only)

    def _step_async(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        step = self.runner.prepare_step(scheduler_output)  # overlaps the step in flight
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            prev_output, prev_step, future = previous
            runner_output = future.result()
            self.runner.record(prev_step, runner_output)
        if step is not None:
            self.runner.launch(step)  # its inputs need the tokens just recorded
            assert self._forward_thread is not None  # async scheduling has its forward thread
            self._in_flight = (scheduler_output, step, self._forward_thread.submit(self.runner.run_step, step))
        if previous is None:
            return []
        return self.scheduler.update_from_output(prev_output, runner_output)  # overlaps the new step

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        """Wait for the step in flight (async scheduling), if any, and return its news."""
        if self._in_flight is None:
            return []
        scheduler_output, step, future = self._in_flight
        self._in_flight = None
        runner_output = future.result()
        self.runner.record(step, runner_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _step_sync(self) -> list[EngineCoreOutput]:
        failed = self._fail_broken_grammars() if self._compiling else []
        scheduler_output = self.scheduler.schedule()
        self._add_grammar_bitmask(scheduler_output)
        started = time.perf_counter()
        runner_output = self.runner.execute_model(scheduler_output)
        if self.drafter is not None:
            self.drafter.observe(scheduler_output, runner_output, time.perf_counter() - started)
        if self.kv_offload is not None:  # before update_from_output frees finished requests
            self.kv_offload.store_computed(scheduler_output, self.scheduler.requests, self.kv_manager.get_block_ids)
        if scheduler_output.is_empty and self._compiling:
            # Nothing can run until a grammar is ready: wait for one instead of spinning.
            self.structured_output.wait_for_compiles(list(self._compiling.values()), GRAMMAR_WAIT_S)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if self._producers:
            self._write_through(outputs)
        if self.drafter is not None:
            self.drafter.draft(self.scheduler.running, self.scheduler.requests)
        return failed + outputs

    def _write_through(self, outputs: list[EngineCoreOutput]) -> None:
        """A disaggregated prefill that finished this step: wait until its KV (stored by
        `store_computed` above) has reached the shared tiers, so the decode worker's lookup finds
        it; the wait counts as the request's transfer time."""
        done = [o for o in outputs if o.finished and o.request_id in self._producers]
        if not done:
            return
        started = time.perf_counter()
        assert self.kv_offload is not None  # producers exist only with the offload connector
        self.kv_offload.wait_for_writes()
        waited = time.perf_counter() - started
        for output in done:
            output.kv_transfer_s += waited
            self._producers.discard(output.request_id)

    def _fail_broken_grammars(self) -> list[EngineCoreOutput]:
        """End the requests whose grammar failed or timed out; forget the ready ones."""
        now = time.monotonic()
        outputs = []
        for req_id, request in list(self._compiling.items()):
            grammar = request.grammar
            assert grammar is not None  # _compiling holds constrained requests
            if request.is_finished or grammar.poll(now):
                del self._compiling[req_id]
            elif grammar.error is not None:
                del self._compiling[req_id]
                self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
                outputs.append(EngineCoreOutput(req_id, [], finish_reason=FinishReason.ABORT, error=grammar.error))
        return outputs

    def _add_grammar_bitmask(self, so: SchedulerOutput) -> None:
        """Bitmask rows for the constrained requests that sample this step (those whose
        scheduled tokens reach their newest token, or their speculative drafts: a row each)."""
        if not self.structured_output.in_use:
            return  # no constrained request yet: nothing to look at on this hot path
        requests, spec = self.scheduler.requests, so.scheduled_spec_tokens
        sampling = [
            (requests[r], spec.get(r, []))
            for r in so.num_scheduled_tokens
            if requests[r].grammar is not None
            and requests[r].num_computed_tokens == requests[r].num_tokens + len(spec.get(r, ()))
        ]
        made = self.structured_output.bitmask(sampling)
        if made is not None:
            so.grammar_bitmask, so.grammar_rows = made
