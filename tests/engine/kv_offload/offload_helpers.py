"""The KV offload engine tests' prompts, reference outputs and helpers
(test_kv_offload_engine.py, test_kv_offload_faults.py; two files so that parallel workers share
the work)."""

from __future__ import annotations

import itertools

import pytest
import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.request.request import Request

CHUNK = 64
BLOCK = 16
NUM_BLOCKS = 40  # 640 tokens: one ~200-token prompt fits a few times, a filler evicts everything
GREEDY = SamplingParams(temperature=0, max_tokens=6)
_fillers = itertools.count()


def _text(n_items: int, start: int = 0) -> str:
    fruits = ["apple", "banana", "cherry", "grape", "lemon", "mango", "orange", "peach", "pear", "plum"]
    lines = [f"Item {i}: a basket holds {i % 7 + 2} {fruits[i % len(fruits)]}s." for i in range(start, start + n_items)]
    return "Inventory list.\n" + "\n".join(lines) + "\nSummary: the basket with the most fruit is"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from pagedserve.engine.model.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    enc = lambda t: tokenizer.encode(t, add_special_tokens=False)
    p = enc(_text(16))  # 219 tokens: 3 whole chunks of 64 and a tail
    q = p[:150] + enc(" Then the list goes on: " + _text(4, start=40))
    r = p[:100] + enc(" Meanwhile, in another story, a cat sat on a mat and looked at the sea for hours.")
    items = {"p": p, "q": q, "r": r, "short": enc("1, 2, 3, 4,")}
    assert 192 < len(p) < 256 and len(q) > 192 and 128 > len(r) > 100, {k: len(v) for k, v in items.items()}
    return items


def make_llm(model_dir, disk=None, dtype="float32", cpu_size_gb=0.2, disk_size_gb=0.5, offload=True):
    options = {"cpu_size_gb": cpu_size_gb, "chunk_size": CHUNK}
    if disk is not None:
        options |= {"disk_path": str(disk), "disk_size_gb": disk_size_gb}
    return LLM(
        model_dir,
        dtype=dtype,
        num_threads=1,
        num_kv_blocks=NUM_BLOCKS,
        max_model_len=NUM_BLOCKS * BLOCK,
        max_num_batched_tokens=NUM_BLOCKS * BLOCK,
        kv_offload=options if offload else None,
    )


@pytest.fixture(scope="module")
def reference(default_model_dir, prompts) -> dict[str, list[int]]:
    """Greedy outputs with offload off (each prompt alone)."""
    llm = make_llm(default_model_dir, offload=False)
    return {name: llm.generate([ids], GREEDY)[0].outputs[0].token_ids for name, ids in prompts.items()}


def greedy(llm: LLM, ids: list[int]) -> list[int]:
    return llm.generate([ids], GREEDY)[0].outputs[0].token_ids


def evict_pool(llm: LLM) -> None:
    """Forget every prefix the engine's pool caches and zero the pool's KV: a request finds its
    prefix only in LMCache, and KV that LMCache failed to write back cannot pass for restored.
    (A filler prompt that needs every block did the same at ~1.3 s of float32 prefill a call.)"""
    assert llm.engine.kv_manager.pool.reset_prefix_cache()  # refused while any block is in use
    for kv in llm.engine.runner.kv_caches:
        kv.zero_()


def run_filler(llm: LLM) -> None:
    """Run a prompt that needs every block of the pool (new tokens each call): its chunks go to
    LMCache, and no cached prefix survives in the pool."""
    n = next(_fillers)
    filler = [(1000 + 37 * n + 11 * i) % 40000 + 100 for i in range(NUM_BLOCKS * BLOCK - 2)]
    llm.generate([filler], SamplingParams(temperature=0, max_tokens=1))
    assert llm.engine.kv_manager.pool.get_num_free_blocks() == NUM_BLOCKS


def pool_kv(llm: LLM, ids: list[int]) -> tuple[list[torch.Tensor], int]:
    """KV of the full blocks of `ids` held in the engine's pool (per layer), and their tokens."""
    probe = Request("probe", list(ids) + [0], SamplingParams())
    blocks, n = llm.engine.kv_manager.get_computed_blocks(probe)
    index = torch.tensor(blocks.block_ids()[0], dtype=torch.int64)  # one KV cache group (Llama)
    return [kv[:, index].clone() for kv in llm.engine.runner.kv_caches], n


def assert_same_kv(got: list[torch.Tensor], ref: list[torch.Tensor], num_tokens: int) -> None:
    nb = num_tokens // BLOCK
    for layer, (g, r) in enumerate(zip(got, ref)):
        assert torch.equal(g[:, :nb], r[:, :nb]), f"layer {layer} differs"


def chunk_files(llm: LLM, ids: list[int], folder) -> list:
    """The disk tier's file of each chunk `ids` stores (whole chunks, then the tail), in order."""
    lmc = llm.engine.kv_offload.engine
    limit = (len(ids) - 1) // BLOCK * BLOCK
    return [
        folder / (key.to_string().replace("/", "-SEP-") + ".data")
        for _, _, key in lmc.token_database.process_tokens(tokens=ids[:limit])
    ]
