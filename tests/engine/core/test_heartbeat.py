"""A stalled worker is noticed (issue 11, finding 12): a real engine-core process on a tiny
random-weight model is stopped with SIGSTOP; once it has been silent past its heartbeat timeout
its in-flight request fails with an error that says so, it is killed, and `on_dead` is called.
A worker that is merely idle keeps sending heartbeats and is left alone."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.async_llm import AsyncLLM, EngineDeadError
from pagedserve.engine.model.tokenizer import load_tokenizer
from pagedserve.engine.request.inputs import EngineInput
from pagedserve.engine.sampling.params import SamplingParams
from tests.server.conftest import tiny_model  # noqa: F401 -- the tiny random-weight model fixture

HEARTBEAT_TIMEOUT_S = 3.0


def _worker(model, deaths: list) -> AsyncLLM:
    config = EngineConfig(model=str(model), dtype="float32", num_kv_blocks=32, max_model_len=256, num_threads=1)
    return AsyncLLM(
        config, load_tokenizer(model), name="w0", on_dead=deaths.append, heartbeat_timeout=HEARTBEAT_TIMEOUT_S
    )


def test_a_stopped_worker_is_killed_and_its_requests_fail(tiny_model):
    async def scenario():
        deaths: list[AsyncLLM] = []
        worker = _worker(tiny_model, deaths)
        await worker.start()
        params = SamplingParams(max_tokens=4, temperature=0.0)
        try:
            # Idle for longer than the timeout: the worker's heartbeats keep it alive.
            idle_until = time.monotonic() + 2 * HEARTBEAT_TIMEOUT_S
            while time.monotonic() < idle_until:
                await asyncio.sleep(0.2)
            assert worker.is_ready and not deaths
            outs = [o async for o in worker.generate("r0", EngineInput(None, [1, 2, 3], params))]
            assert outs[-1].finished

            pid = worker.pid
            os.kill(pid, signal.SIGSTOP)
            with pytest.raises(EngineDeadError, match="stalled, killed") as failed:
                async for _ in worker.generate("r1", EngineInput(None, [1, 2, 3], params)):
                    pass
            assert "worker_heartbeat_timeout 3 s" in str(failed.value)
            assert deaths == [worker] and not worker.is_ready
            assert "stalled" in worker.dead_reason
            process = worker._client.process
            await asyncio.get_running_loop().run_in_executor(None, process.join, 30)
            assert process.exitcode == -signal.SIGKILL  # SIGKILL ends it although stopped
        finally:
            await worker.shutdown()

    asyncio.run(scenario())
