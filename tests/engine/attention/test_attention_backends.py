"""The attention backends (torch, torch with the CPU decode kernel, Triton in its interpreter)
against a per-token float64 reference on a scrambled paged cache."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.attention.metadata import AttentionMetadata
from pagedserve.engine.attention.selector import select_backend
from pagedserve.engine.attention.torch_backend import TorchAttentionBackend, group_decodes
from pagedserve.engine.config.engine import EngineConfig
from pagedserve.kernels.cpu_paged_attention import load_cpu_kernels

BLOCK_SIZE, NUM_BLOCKS, HEADS, KV_HEADS, HEAD_DIM = 16, 64, 6, 2, 8


def make_meta(seqs: list[tuple[int, int]], g: torch.Generator) -> AttentionMetadata:
    """`seqs` = (query_len, seq_len) each, decodes first; block tables are scrambled."""
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, slots = [], []
    for query_len, seq_len in seqs:
        n = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
        tables.append(perm[:n])
        perm = perm[n:]
        slots += [
            tables[-1][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len - query_len, seq_len)
        ]
    width = max(len(t) for t in tables)
    query_lens, seq_lens = [q for q, _ in seqs], [s for _, s in seqs]
    return AttentionMetadata(
        num_seqs=len(seqs),
        num_tokens=sum(query_lens),
        query_lens=query_lens,
        seq_lens=seq_lens,
        query_start_loc=torch.tensor([0] + query_lens).cumsum(0).to(torch.int32),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_decodes=next((i for i, q in enumerate(query_lens) if q != 1), len(seqs)),
    )


def reference(query, kv_cache, meta, scale):
    """Attention of each query token to positions <= its own, read token by token from the cache."""
    out, row = [], 0
    group = HEADS // KV_HEADS
    for i in range(meta.num_seqs):
        table = meta.block_tables[i].tolist()
        for pos in range(meta.seq_lens[i] - meta.query_lens[i], meta.seq_lens[i]):
            slots = [table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE for t in range(pos + 1)]
            k = kv_cache[0].reshape(-1, KV_HEADS, HEAD_DIM)[slots].double().repeat_interleave(group, 1)
            v = kv_cache[1].reshape(-1, KV_HEADS, HEAD_DIM)[slots].double().repeat_interleave(group, 1)
            scores = torch.einsum("hd,thd->ht", query[row].double(), k) * scale
            out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))
            row += 1
    return torch.stack(out)


# Decode lengths 300 and 250 vs <= 12: the decodes run as two length groups, rows interleaved.
# (5, 45) and (2, 2) are short chunks (speculative verification, a tiny prompt): with the CPU
# kernel they run as decode-kernel rows.
MIXED = [
    (1, 300),
    (1, 12),
    (1, 5),
    (1, 250),
    (1, 7),
    (1, 17),
    (1, 3),
    (1, 11),
    (9, 9),
    (20, 57),
    (1, 40),
    (5, 45),
    (2, 2),
]


def _cpu_kernel_backend() -> TorchAttentionBackend:
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU attention kernel could not be built here")
    return TorchAttentionBackend(cpu_kernels=kernels)


def _triton_backend():
    pytest.importorskip("triton")
    return select_backend("cpu", "triton")  # Triton's interpreter (tests/conftest.py)


@pytest.mark.parametrize(
    "make_backend", [TorchAttentionBackend, _cpu_kernel_backend, _triton_backend], ids=["torch", "cpu-kernel", "triton"]
)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_mixed_batch_matches_reference_across_layers(dtype, tol, make_backend):
    g = torch.Generator().manual_seed(0)
    # (1, 40) is a 1-token chunk after prefills: handled as a prefill, not a decode.
    meta = make_meta(MIXED, g)
    assert meta.num_decodes == 8 and len(group_decodes(meta.seq_lens[:8])) == 2
    backend = make_backend()
    for _layer in range(2):  # the per-step decode plan is reused by the second layer
        cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        q = torch.randn(meta.num_tokens, HEADS, HEAD_DIM, generator=g).to(dtype)
        k = torch.randn(meta.num_tokens, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        v = torch.randn(meta.num_tokens, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        out = backend.forward(q, k, v, cache, meta, 0.3)
        assert out.shape == q.shape and out.dtype == dtype
        torch.testing.assert_close(cache[0].view(-1, KV_HEADS, HEAD_DIM)[meta.slot_mapping], k)
        torch.testing.assert_close(out.double(), reference(q, cache, meta, 0.3), atol=tol, rtol=tol)


def test_decode_plan_follows_new_metadata():
    g = torch.Generator().manual_seed(1)
    backend = TorchAttentionBackend()
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g)
    for seqs in ([(1, 30), (1, 31)], [(1, 70), (1, 2), (1, 16)]):
        meta = make_meta(seqs, g)
        q = torch.randn(meta.num_tokens, HEADS, HEAD_DIM, generator=g)
        kv = torch.randn(meta.num_tokens, KV_HEADS, HEAD_DIM, generator=g)
        out = backend.forward(q, kv, kv, cache, meta, 0.5)
        torch.testing.assert_close(out.double(), reference(q, cache, meta, 0.5), atol=1e-5, rtol=1e-5)


def test_group_decodes():
    assert group_decodes([300, 280, 250]) == [[0, 1, 2]]
    assert group_decodes([10, 2000, 12, 1900, 11]) == [[1, 3], [2, 4, 0]]
    assert group_decodes([100, 40]) == [[0, 1]]  # splitting would save less than a group costs


def test_rejects_mismatched_shapes():
    meta = make_meta([(3, 3)], torch.Generator().manual_seed(2))
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    q, kv = torch.zeros(3, HEADS, HEAD_DIM), torch.zeros(3, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="tokens"):
        TorchAttentionBackend().forward(q[:2], kv[:2], kv[:2], cache, meta, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        TorchAttentionBackend().forward(q.bfloat16(), kv.bfloat16(), kv.bfloat16(), cache, meta, 1.0)


def test_backend_selection(monkeypatch):
    assert select_backend("cpu").name == "torch"
    assert select_backend("cpu", "torch").name == "torch"
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        select_backend("cpu", "flash")
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_backend("cpu", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend("cpu", "triton").name == "triton"


def test_engine_config_checks_the_backend_name():
    assert EngineConfig("m", attention_backend="triton").attention_backend == "triton"
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig("m", attention_backend="flash")
