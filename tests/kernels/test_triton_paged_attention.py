"""The Triton paged-attention kernel against its plain-torch reference.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET),
so shapes stay small.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels.triton_paged_attention import paged_attention, paged_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(dtype, heads, kv_heads, head_dim, block_size, seqs, seed=0, query_padding=0):
    """seqs: (query_len, seq_len) per sequence; block tables scrambled, padded with block 0."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // block_size) for _, s in seqs)
    num_blocks = len(seqs) * max_blocks + 2
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for _, seq_len in seqs:
        n = -(-seq_len // block_size)
        tables.append(perm[:n] + [0] * (max_blocks - n))
        perm = perm[n:]
    query_lens = [q for q, _ in seqs]
    # query_padding > 0: a view with extra heads per token, as a fused QKV projection leaves it.
    q = torch.randn(sum(query_lens), heads + query_padding, head_dim, generator=g).to(dtype)[:, :heads]
    return (
        q.to(DEVICE),
        k.to(DEVICE),
        v.to(DEVICE),
        torch.tensor(tables, dtype=torch.int32, device=DEVICE),
        torch.tensor([s for _, s in seqs], dtype=torch.int32, device=DEVICE),
        torch.tensor([0] + query_lens, device=DEVICE).cumsum(0).to(torch.int32),
        max(query_lens),
    )


# Decodes, a prefill chunk after cached context, a whole prompt, and a 1-token chunk.
MIXED = [(1, 1), (1, 40), (1, 17), (7, 30), (12, 12), (1, 5)]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [
        (9, 3, 64, 16),  # SmolLM2: a group of 3 padded to 4
        (4, 4, 32, 4),  # no GQA; one key tile spans 4 pages
        (8, 1, 24, 32),  # one KV head for 8 query heads; head_dim not a power of two
    ],
)
def test_matches_reference(dtype, tol, heads, kv_heads, head_dim, block_size):
    q, k, v, tables, seq_lens, starts, max_q = _inputs(dtype, heads, kv_heads, head_dim, block_size, MIXED)
    out = paged_attention(q, k, v, tables, seq_lens, starts, max_q, 0.125)
    ref = paged_attention_reference(q, k, v, tables, seq_lens, starts, 0.125)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_long_prefill_spans_several_query_tiles_and_strided_query():
    # 70 new tokens after 30 cached: several programs per sequence, each with its own causal limit.
    q, k, v, tables, seq_lens, starts, max_q = _inputs(
        torch.float32, 6, 2, 16, 16, [(1, 90), (70, 100)], query_padding=3
    )
    assert not q.is_contiguous()
    out = paged_attention(q, k, v, tables, seq_lens, starts, max_q, 0.25)
    torch.testing.assert_close(
        out, paged_attention_reference(q, k, v, tables, seq_lens, starts, 0.25), atol=1e-5, rtol=1e-5
    )


def test_reference_is_causal_attention():
    # One sequence with one KV head: the reference equals SDPA with a bottom-right causal mask.
    q, k, v, tables, seq_lens, starts, _ = _inputs(torch.float32, 1, 1, 8, 4, [(3, 10)])
    ref = paged_attention_reference(q, k, v, tables, seq_lens, starts, 0.5)
    pos = torch.arange(10, device=q.device)
    keys = k[tables[0].long()[pos // 4], pos % 4, 0]
    values = v[tables[0].long()[pos // 4], pos % 4, 0]
    mask = pos[None, :] <= torch.arange(7, 10, device=q.device)[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q[:, 0][None], keys[None], values[None], attn_mask=mask, scale=0.5
    )[0]
    torch.testing.assert_close(ref[:, 0], expected)


def test_refuses_heads_not_a_multiple_of_kv_heads():
    q, k, v, tables, seq_lens, starts, max_q = _inputs(torch.float32, 4, 3, 8, 4, [(1, 3)])
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(q, k, v, tables, seq_lens, starts, max_q, 1.0)
