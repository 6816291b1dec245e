"""AsyncLLM against a real engine-core process running the default model."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time

import pytest

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.async_llm import AsyncLLM, EngineDeadError, EngineStartError
from pagedserve.engine.model.tokenizer import load_tokenizer
from pagedserve.engine.request.inputs import EngineInput, InvalidInput, validate_input
from pagedserve.engine.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _config(model_dir, **overrides) -> EngineConfig:
    options = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 512, "num_threads": 1}
    return EngineConfig(model=str(model_dir), **(options | overrides))


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def _chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


async def _collect(worker, request_id, token_ids, params):
    outs = [out async for out in worker.generate(request_id, EngineInput(None, token_ids, params))]
    return outs


async def _wait_all_free(worker, timeout=10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = worker.stats
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == stats.num_kv_blocks:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"blocks still held: {worker.stats}")


def test_worker_serves_streams_aborts_and_reports_death(default_model_dir, tokenizer):
    """One worker process through its whole life (one start keeps the test fast)."""

    async def scenario():
        deaths = []
        worker = AsyncLLM(_config(default_model_dir), tokenizer, name="w0", on_dead=deaths.append)
        info = await worker.start()
        assert info.pid == worker.pid != os.getpid()
        assert info.max_model_len == 512 and info.num_kv_blocks == 64 and info.vocab_size == 49152
        assert worker.is_ready and not worker.is_dead

        # Greedy chat answer, streamed: cumulative outputs, final one finished with timings.
        ids = _chat_ids(tokenizer, FRANCE)
        outs = await _collect(worker, "france", ids, SamplingParams(temperature=0, max_tokens=12))
        final = outs[-1]
        assert final.finished and not any(o.finished for o in outs[:-1])
        assert final.outputs[0].text.startswith("The capital of France is Paris.")
        texts = [o.outputs[0].text for o in outs]
        assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
        m = final.metrics
        assert all(o.metrics is None for o in outs[:-1])
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.ttft_s == pytest.approx(m.queued_s + m.prefill_s)
        assert m.decode_s == pytest.approx(m.finished_time - m.first_token_time)
        assert len(m.itl_s) == len(outs) - 1

        # Concurrent requests, n=2 with a seed, a stop string; then a repeat hits the prefix cache.
        sampled = SamplingParams(temperature=1.0, n=2, seed=7, max_tokens=8)
        a, b = await asyncio.gather(
            _collect(worker, "n2", ids, sampled),
            _collect(worker, "stop", ids, SamplingParams(temperature=0, max_tokens=20, stop=["Paris"])),
        )
        assert [c.index for c in a[-1].outputs] == [0, 1]
        assert all(len(c.token_ids) == 8 for c in a[-1].outputs)
        again = await _collect(worker, "n2-again", ids, sampled)
        assert [c.token_ids for c in again[-1].outputs] == [c.token_ids for c in a[-1].outputs]
        assert again[-1].num_cached_tokens >= 16
        stop = b[-1].outputs[0]
        assert stop.text == "The capital of France is " and stop.finish_reason == "stop" and stop.stop_reason == "Paris"

        # Leaving a stream early aborts the request and frees its blocks; so does abort().
        gen = worker.generate(
            "early", EngineInput(None, ids, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        )
        async for _ in gen:
            break
        await gen.aclose()
        seen = []

        async def consume():
            async for out in worker.generate(
                "ab", EngineInput(None, ids, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
            ):
                seen.append(out)

        task = asyncio.create_task(consume())
        while not seen:
            await asyncio.sleep(0.01)
        await worker.abort("ab")
        await asyncio.wait_for(task, 10)
        assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
        await _wait_all_free(worker)
        assert worker.num_unfinished == 0

        # Bad input is refused where it enters, against the worker's limits (the front end's
        # prepare step runs this one check; the worker takes an EngineInput as checked).
        with pytest.raises(InvalidInput, match="max_model_len") as info:
            validate_input([1] * 600, SamplingParams(), worker.limits)
        assert info.value.field == "prompt"
        with pytest.raises(InvalidInput, match="out of range"):
            validate_input([49152], SamplingParams(), worker.limits)
        with pytest.raises(InvalidInput, match="at most 12 tokens") as info:  # the server's rule
            validate_input([1] * 500, SamplingParams(max_tokens=13), worker.limits)
        assert info.value.field == "max_tokens"

        # kill -9 during a stream: the stream fails within seconds, on_dead fires once.
        stream = worker.generate(
            "doomed", EngineInput(None, ids, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        )
        await stream.__anext__()
        os.kill(worker.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="exit"):
            async for _ in stream:
                pass
        assert time.monotonic() - started < 5
        assert deaths == [worker] and worker.is_dead and not worker.is_ready
        with pytest.raises(EngineDeadError):
            await _collect(worker, "after", ids, SamplingParams(max_tokens=2))
        await worker.shutdown()

    asyncio.run(scenario())


def test_graceful_shutdown_fails_in_flight_requests(default_model_dir, tokenizer):
    async def scenario():
        worker = AsyncLLM(_config(default_model_dir), tokenizer, name="w1")
        await worker.start()
        stream = worker.generate(
            "x", EngineInput(None, [1, 2, 3], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        )
        await stream.__anext__()
        process = worker._client.process
        await worker.shutdown(timeout=10)
        assert process.exitcode == 0
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass

    asyncio.run(scenario())


def test_start_failure_is_reported(tmp_path, tokenizer):
    async def scenario():
        (tmp_path / "config.json").write_text('{"architectures": ["NoSuchModel"], "vocab_size": 10}')
        worker = AsyncLLM(EngineConfig(model=str(tmp_path), num_threads=1), tokenizer, name="bad")
        with pytest.raises(EngineStartError, match="failed"):
            await worker.start(timeout=120)
        assert worker.is_dead and not worker.is_ready

    asyncio.run(scenario())
