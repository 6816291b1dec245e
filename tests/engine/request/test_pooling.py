"""Pooling requests through the real EngineCore on a tiny random-weight Llama: the vector is the
last prompt token's final hidden state (Hugging Face's `last_hidden_state`), L2-normalised; the
same with chunked prefill and a prefix-cache hit; beside generating requests in one batch, which
keep their tokens; and the request frees every block."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.request.pooling import PoolingParams, pool_last_token
from pagedserve.engine.request.request import Request
from pagedserve.engine.sampling.params import SamplingParams

PROMPT = [3, 14, 15, 9, 26, 53, 5, 8, 9, 7, 9, 32, 38, 46, 26, 43, 38, 32, 7, 9, 50]


def make_engine(model_dir, **options) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=str(model_dir), dtype="float32", num_kv_blocks=64, block_size=4, max_model_len=128, **options
        )
    )


def run(engine: EngineCore, requests: list[Request]) -> dict[str, list]:
    """Steps until every request finished: request id -> its outputs."""
    for r in requests:
        engine.add_request(r)
    outs: dict[str, list] = {r.request_id: [] for r in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


def embed_request(req_id: str, prompt: list[int], normalize: bool = True) -> Request:
    return Request(
        req_id, prompt, SamplingParams(max_tokens=1, temperature=0), pooling_params=PoolingParams(normalize=normalize)
    )


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> torch.Tensor:
    """Hugging Face's final hidden state (after the last norm) of PROMPT's last token."""
    model = transformers.LlamaModel.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).last_hidden_state[0, -1]


def test_pool_last_token_normalises_only_when_asked():
    rows = torch.tensor([[3.0, 4.0], [3.0, 4.0]], dtype=torch.bfloat16)
    pooled = pool_last_token(rows, [PoolingParams(), PoolingParams(normalize=False)])
    assert pooled[0] == pytest.approx([0.6, 0.8]) and pooled[1] == [3.0, 4.0]


def test_vector_is_the_normalised_last_hidden_state(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir)
    [out] = run(engine, [embed_request("e", PROMPT)])["e"]
    assert out.finished and out.new_token_ids == [] and out.finish_reason == "stop"
    vector = torch.tensor(out.pooled)
    assert vector.norm().item() == pytest.approx(1.0, abs=1e-5)
    torch.testing.assert_close(vector, reference / reference.norm(), atol=1e-4, rtol=1e-4)
    [raw] = run(engine, [embed_request("raw", PROMPT, normalize=False)])["raw"]
    torch.testing.assert_close(torch.tensor(raw.pooled), reference, atol=1e-4, rtol=1e-4)
    assert engine.kv_manager.pool.get_num_free_blocks() == engine.runner.num_blocks


def test_chunked_prefix_cached_and_batched_with_generation(tiny_model_dir, reference):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=8)  # the prompt takes three steps
    generate = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    alone = [
        t for o in run(make_engine(tiny_model_dir), [Request("g", PROMPT[:7], generate)])["g"] for t in o.new_token_ids
    ]
    outs = run(engine, [embed_request("e", PROMPT), Request("g", PROMPT[:7], generate)])
    [embedded] = outs["e"]
    assert len(engine.scheduler.requests) == 0
    torch.testing.assert_close(torch.tensor(embedded.pooled), reference / reference.norm(), atol=1e-4, rtol=1e-4)
    assert [t for o in outs["g"] for t in o.new_token_ids] == alone  # the generating request is unchanged
    [cached] = run(engine, [embed_request("again", PROMPT)])["again"]
    assert cached.num_cached_tokens > 0  # most of the prompt came from the prefix cache
    torch.testing.assert_close(torch.tensor(cached.pooled), torch.tensor(embedded.pooled), atol=1e-5, rtol=1e-5)
    assert engine.kv_manager.pool.get_num_free_blocks() == engine.runner.num_blocks


def test_no_drafts_for_a_pooling_request(tiny_model_dir):
    """Speculative decoding drafts after a request's newest token; a pooling request whose first
    chunk stops one token short of its prompt's end must still pool, not verify drafts."""
    prompt = list(range(10, 20)) * 2  # its end repeats its start: the n-gram drafter would propose
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=19, speculative={"num_speculative_tokens": 3})
    request = Request("e", prompt, SamplingParams(max_tokens=8, temperature=0), pooling_params=PoolingParams())
    [out] = run(engine, [request])["e"]
    assert out.new_token_ids == [] and len(out.pooled) == 32
    assert engine.scheduler.num_draft_tokens == 0
