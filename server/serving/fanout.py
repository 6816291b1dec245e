"""Several prompts answered as one request (/v1/completions with a list of prompts).

`FanOut` stands where `pagedserve.server.serving.generation.respond` expects a worker: `generate` runs each prepared
prompt on the worker its prepare step picked (as sub-request `{request_id}-{i}`) and yields one
merged cumulative `RequestOutput` each time any of them changes, once every one has answered:
prompt i's choice j is choice i * n + j (OpenAI's numbering), usage adds up, and the merged
output is finished when all are. `interrupt` reaches every sub-request, and leaving the iterator
early aborts every one that has not finished (each worker's own iterator does that).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from pagedserve.engine.request.inputs import EngineInput
from pagedserve.engine.request.outputs import RequestOutput
from pagedserve.server.serving.generation import Prepared


@dataclass(slots=True)
class FanOut:
    jobs: list[Prepared]
    n: int  # choices per prompt

    def prepared(self) -> Prepared:
        """What `respond` takes: this fan-out as the worker, the first prompt's input (its
        sampling params are every prompt's)."""
        return Prepared(self, self.jobs[0].input)

    async def generate(
        self, request_id: str, inp: EngineInput, *, arrival_time: float | None = None, priority: int = 0
    ) -> AsyncGenerator[RequestOutput, None]:
        streams = [
            job.worker.generate(f"{request_id}-{i}", job.input, arrival_time=arrival_time, priority=job.input.priority)
            for i, job in enumerate(self.jobs)
        ]
        latest: list[RequestOutput | None] = [None] * len(streams)
        pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    i = pending.pop(future)
                    out = latest[i] = future.result()  # an engine error or an interrupt raises here
                    if not out.finished:
                        pending[asyncio.ensure_future(anext(streams[i]))] = i
                outputs = [out for out in latest if out is not None]
                if len(outputs) == len(latest):
                    yield merge_outputs(request_id, outputs, self.n)
        finally:
            for future in pending:
                future.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for s in streams:
                with contextlib.suppress(RuntimeError):
                    await s.aclose()

    def interrupt(self, request_id: str, error: BaseException) -> None:
        for i, job in enumerate(self.jobs):
            job.worker.interrupt(f"{request_id}-{i}", error)


def merge_outputs(request_id: str, outputs: list[RequestOutput], n: int) -> RequestOutput:
    """Per-prompt outputs -> one output: choice j of prompt i becomes choice i * n + j; prompt
    tokens and cached tokens add up; the metrics are the first prompt's."""
    choices = [dataclasses.replace(c, index=i * n + c.index) for i, out in enumerate(outputs) for c in out.outputs]
    finished = all(out.finished for out in outputs)
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[t for out in outputs for t in out.prompt_token_ids],
        outputs=choices,
        finished=finished,
        num_cached_tokens=sum(out.num_cached_tokens for out in outputs),
        num_external_cached_tokens=sum(out.num_external_cached_tokens for out in outputs),
        prefix_miss=next((out.prefix_miss for out in outputs if out.prefix_miss is not None), None),
        metrics=outputs[0].metrics if finished else None,
    )
