"""The fused decode layers (kernels/csrc/decode_layer.h, the extension's DecodeStack) against a
float64 reference of the Llama layer on random shapes with ragged tails (hidden, head_dim and
MLP widths that are no multiple of 8 or 16), on every instruction-set path this CPU runs, and the
AVX2 path forced on an AVX-512 machine against the AVX-512 one. The real model's greedy tokens
with and without the fused path: tests/engine/model/test_fused_decode.py."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.kernels.cpu_native import ISA_NAMES, available_isas, load_native
from tests.kernels import built_or_skip


@pytest.fixture(scope="module")
def ext():
    return built_or_skip(load_native, "native")


@pytest.fixture(scope="module")
def isas(ext):
    return [isa for isa in ISA_NAMES if isa in available_isas(ext)]


HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, BLOCK = 40, 4, 2, 10, 37, 2, 4
MAX_POS, BLOCKS, EPS = 64, 24, 1e-5


def _weights(g: torch.Generator, dtype: torch.dtype, bias: bool) -> list[list[torch.Tensor | None]]:
    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    angles = torch.arange(MAX_POS, dtype=torch.float64)[:, None] * inv[None, :]

    def mat(n, k):
        return (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype)

    def vec(n, base=0.0):
        return (base + 0.1 * torch.randn(n, generator=g)).to(dtype)

    layers = []
    for _ in range(LAYERS):
        layers.append(
            [
                vec(HIDDEN, 1.0),
                vec(HIDDEN, 1.0),
                mat(qkv, HIDDEN),
                vec(qkv) if bias else None,
                mat(HIDDEN, HEADS * HEAD_DIM),
                vec(HIDDEN) if bias else None,
                mat(2 * INTER, HIDDEN),
                None,
                mat(HIDDEN, INTER),
                None,
                angles.cos().to(dtype),
                angles.sin().to(dtype),
            ]
        )
    return layers


def _step(g: torch.Generator, lens: list[int], dtype: torch.dtype):
    """Block tables (distinct shuffled blocks per row), positions, slots and caches with context."""
    rows = len(lens)
    width = max(math.ceil(n / BLOCK) for n in lens) + 1
    perm = torch.randperm(BLOCKS, generator=g)
    tables = torch.zeros(rows, width, dtype=torch.int32)
    used = 0
    for r, n in enumerate(lens):
        need = math.ceil(n / BLOCK)
        tables[r, :need] = perm[used : used + need].int()
        used += need
    positions = torch.tensor([n - 1 for n in lens], dtype=torch.long)
    slots = torch.tensor(
        [int(tables[r, p // BLOCK]) * BLOCK + p % BLOCK for r, p in enumerate(positions.tolist())], dtype=torch.long
    )
    caches = [torch.randn(2, BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(LAYERS)]
    return tables, positions, slots, torch.tensor(lens, dtype=torch.int32), caches


def _reference(weights, h, residual, caches, positions, slots, tables, lens, scale):
    """float64 Llama layers: h, residual after every layer; the caches (float64) get the new K/V."""
    d = torch.float64
    h = h.to(d)
    residual = None if residual is None else residual.to(d)
    half = HEAD_DIM // 2

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.to(d)

    def linear(x, w, b):
        y = x @ w.to(d).t()
        return y if b is None else y + b.to(d)

    for (n1, n2, wqkv, bqkv, wo, bo, wgu, bgu, wd, bd, cos, sin), kv in zip(weights, caches):
        residual = h if residual is None else residual + h
        qkv = linear(norm(residual, n1), wqkv, bqkv)
        qk = qkv[:, : (HEADS + KV_HEADS) * HEAD_DIM].view(-1, HEADS + KV_HEADS, HEAD_DIM)
        c, s = cos.to(d)[positions][:, None], sin.to(d)[positions][:, None]
        x1, x2 = qk[..., :half], qk[..., half:]
        qk = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        q, k = qk[:, :HEADS], qk[:, HEADS:]
        v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(-1, KV_HEADS, HEAD_DIM)
        flat = kv.view(2, -1, KV_HEADS, HEAD_DIM)
        flat[0, slots], flat[1, slots] = k, v
        out = torch.empty(len(lens), HEADS, HEAD_DIM, dtype=d)
        for r, n in enumerate(lens.tolist()):
            t = torch.arange(n)
            rows = tables[r, t // BLOCK].long() * BLOCK + t % BLOCK
            keys, values = flat[0, rows], flat[1, rows]  # [n, kv_heads, D]
            for hd in range(HEADS):
                kvh = hd // (HEADS // KV_HEADS)
                p = torch.softmax(keys[:, kvh] @ q[r, hd] * scale, dim=0)
                out[r, hd] = p @ values[:, kvh]
        residual = residual + linear(out.reshape(len(lens), -1), wo, bo)
        gu = linear(norm(residual, n2), wgu, bgu)
        h = linear(torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:], wd, bd)
    return h, residual


def _run(ext, weights, dtype, inputs, isa, first=0, last=LAYERS):
    h, residual, caches, positions, slots, tables, lens, scale = inputs
    stack = ext.DecodeStack(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, EPS, weights, [scale] * LAYERS)
    caches = [c.clone() for c in caches]
    out_h, out_r = stack.forward(first, last, h, residual, caches[first:last], positions, slots, tables, lens, isa=isa)
    return out_h, out_r, caches


def _inputs(seed: int, lens: list[int], dtype: torch.dtype, with_residual: bool):
    g = torch.Generator().manual_seed(seed)
    tables, positions, slots, lens_t, caches = _step(g, lens, dtype)
    h = torch.randn(len(lens), HIDDEN, generator=g).to(dtype)
    residual = torch.randn(len(lens), HIDDEN, generator=g).to(dtype) if with_residual else None
    return g, (h, residual, caches, positions, slots, tables, lens_t, HEAD_DIM**-0.5)


@pytest.mark.parametrize(
    "lens,bias,with_residual",
    [([1], False, False), ([9], True, True), ([5, 1, 12], False, True), ([3, 8, 2, 17, 6, 11], True, False)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layers_against_float64(ext, isas, lens, bias, with_residual, dtype):
    g, inputs = _inputs(len(lens) * 7 + bias, lens, dtype, with_residual)
    weights = _weights(g, dtype, bias)
    h, residual, caches, positions, slots, tables, lens_t, scale = inputs
    want_caches = [c.double() for c in caches]
    want_h, want_r = _reference(weights, h, residual, want_caches, positions, slots, tables, lens_t, scale)
    # float32: summation order only; bf16: every op's result rounded to bf16 (2^-8) along two layers
    rtol, atol = (1e-4, 1e-4) if dtype == torch.float32 else (6e-2, 6e-2)
    for isa in isas:
        got_h, got_r, got_caches = _run(ext, weights, dtype, inputs, isa)
        assert got_h.dtype == got_r.dtype == dtype
        torch.testing.assert_close(got_h.double(), want_h, rtol=rtol, atol=atol, msg=lambda m: f"{isa} h: {m}")
        torch.testing.assert_close(got_r.double(), want_r, rtol=rtol, atol=atol, msg=lambda m: f"{isa} residual: {m}")
        for got, want in zip(got_caches, want_caches):  # the new K/V at the slots, the rest untouched
            flat_got, flat_want = got.double().view(2, -1, KV_HEADS * HEAD_DIM), want.view(2, -1, KV_HEADS * HEAD_DIM)
            torch.testing.assert_close(flat_got, flat_want, rtol=rtol, atol=atol, msg=lambda m: f"{isa} cache: {m}")


def test_a_range_of_layers_runs_those_layers_only(ext, isas):
    """Layers [1, 2) of the stack: the same as a one-layer stack of layer 1."""
    g, inputs = _inputs(3, [4, 9], torch.float32, True)
    weights = _weights(g, torch.float32, False)
    h, residual, caches, positions, slots, tables, lens_t, scale = inputs
    got_h, got_r, got_caches = _run(ext, weights, torch.float32, inputs, isas[-1], first=1, last=2)
    want_caches = [caches[1].double()]
    want_h, want_r = _reference(weights[1:], h, residual, want_caches, positions, slots, tables, lens_t, scale)
    torch.testing.assert_close(got_h.double(), want_h, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_r.double(), want_r, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_caches[1].double(), want_caches[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(got_caches[0], caches[0])  # layer 0's cache is not touched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_forced_equals_avx512(ext, isas, dtype):
    """The AVX2 path (what an AVX2-only CPU runs) against the AVX-512 one on this machine (on an
    AVX2-only CPU: the scalar path against AVX2). Equal up to summation order: the GEMVs and
    dot products sum 8-wide vectors instead of 16-wide ones."""
    pair = ("avx2", "avx512") if "avx512" in isas else ("scalar", "avx2")
    if pair[1] not in isas:
        pytest.skip("no vector path on this CPU")
    g, inputs = _inputs(11, [7, 1, 20], dtype, True)
    weights = _weights(g, dtype, True)
    a = _run(ext, weights, dtype, inputs, pair[0])
    b = _run(ext, weights, dtype, inputs, pair[1])
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: a sum that lands on the other side of a rounding
    for x, y in zip(a[:2] + tuple(a[2]), b[:2] + tuple(b[2])):
        torch.testing.assert_close(x.double(), y.double(), rtol=tol, atol=tol)


def test_bad_arguments_are_refused(ext):
    g, inputs = _inputs(5, [3], torch.float32, False)
    weights = _weights(g, torch.float32, False)
    h, residual, caches, positions, slots, tables, lens_t, scale = inputs
    stack = ext.DecodeStack(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, EPS, weights, [scale] * LAYERS)
    assert stack.num_layers == LAYERS
    with pytest.raises(RuntimeError, match="one KV cache per layer"):
        stack.forward(0, 2, h, None, caches[:1], positions, slots, tables, lens_t)
    with pytest.raises(RuntimeError, match="slot out of the KV cache"):
        stack.forward(0, 1, h, None, caches[:1], positions, slots + BLOCKS * BLOCK, tables, lens_t)
    with pytest.raises(RuntimeError, match="position past the RoPE table"):
        stack.forward(0, 1, h, None, caches[:1], positions + MAX_POS, slots, tables, lens_t)
    with pytest.raises(RuntimeError, match="model dtype"):
        stack.forward(0, 1, h.bfloat16(), None, caches[:1], positions, slots, tables, lens_t)
    bad = [list(layer) for layer in weights]
    bad[1][2] = bad[1][2][:-1]
    with pytest.raises(RuntimeError, match="layer 1: entry 2 shape"):
        ext.DecodeStack(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, EPS, bad, [scale] * LAYERS)
