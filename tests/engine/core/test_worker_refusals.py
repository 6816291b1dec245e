"""A worker answers an input message it refuses (issue 11, finding 3): a request whose fields its
decoder rejects ends at once with an error output naming the field, instead of being dropped
(which left the front end waiting until its responseTimeout), and the worker keeps serving."""

from __future__ import annotations

import time

import msgspec

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.client import MPClient
from pagedserve.engine.core.messages import EngineCoreRequest
from pagedserve.engine.sampling.params import SamplingParams
from tests.server.conftest import tiny_model  # noqa: F401 -- the tiny random-weight model fixture


def _outputs_for(client: MPClient, request_id: str, deadline_s: float = 120.0) -> list:
    """Outputs for one request until it finishes (the worker is real: wait on its socket)."""
    seen, deadline = [], time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        batch = client.get_output(timeout=1.0)
        for out in batch.outputs if batch is not None else []:
            if out.request_id == request_id:
                seen.append(out)
                if out.finish_reason is not None:
                    return seen
    raise AssertionError(f"no finished output for {request_id} within {deadline_s} s")


def test_a_refused_request_is_answered_with_an_error_and_the_worker_serves_on(tiny_model):
    config = EngineConfig(model=str(tiny_model), dtype="float32", num_kv_blocks=32, max_model_len=256, num_threads=1)
    client = MPClient(config, name="refusals")
    try:
        client.wait_ready(timeout=300)
        # What a front end that skipped validation would send: "ignore_eos": "yes".
        bad = {
            "type": "add",
            "request_id": "bad",
            "prompt_token_ids": [1, 2, 3],
            "sampling_params": {"max_tokens": 2, "ignore_eos": "yes"},
        }
        client._input.send(msgspec.msgpack.encode(bad))
        refused = _outputs_for(client, "bad")
        assert refused[-1].error is not None and "ignore_eos" in refused[-1].error
        assert refused[-1].new_token_ids == []

        ok = EngineCoreRequest("ok", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        client.add_request(ok)
        served = _outputs_for(client, "ok")
        assert served[-1].error is None
        assert sum(len(o.new_token_ids) for o in served) == 2
    finally:
        client.shutdown()
