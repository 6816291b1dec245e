"""The fused decode layers (kernels/csrc/decode_layer.h, the extension's DecodeStack) against a
float64 reference of the layer, with plain (float32 / bfloat16), int8 and int4 projections, in
the Llama shape and its variants (Qwen3's q/k norms; Gemma's sandwich norms, GELU, sliding
window and soft-capped scores), on every instruction-set path this CPU runs, and the AVX2 path
forced on an AVX-512 machine against the AVX-512 one. Plain and int8 run ragged shapes (hidden,
head_dim and MLP widths that are no multiple of 8 or 16); int4 needs whole packed blocks (64
output rows, groups of 32 inputs). The real model's greedy tokens with and without the fused
path: tests/engine/model/test_fused_decode.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.model.fused_decode import proj_arg
from pagedserve.engine.model.quant_linear import Int4Linear, Int8Linear
from pagedserve.kernels.cpu_native import ISA_NAMES, available_isas, load_native
from tests.kernels import built_or_skip


@pytest.fixture(scope="module")
def ext():
    return built_or_skip(load_native, "native")


@pytest.fixture(scope="module")
def isas(ext):
    return [isa for isa in ISA_NAMES if isa in available_isas(ext)]


@dataclass(frozen=True)
class Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    layers: int = 2
    block: int = 4
    max_pos: int = 64
    blocks: int = 24
    eps: float = 1e-5

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """(out, in) of qkv, o, gate_up, down."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        return [(qkv, self.hidden), (self.hidden, self.heads * self.head_dim), (2 * self.inter, self.hidden),
                (self.hidden, self.inter)]  # fmt: skip


@dataclass(frozen=True)
class Style:
    """The layer variant: Llama's by default."""

    sandwich: bool = False  # Gemma's four norms
    gemma_norm: bool = False  # (x / rms) * (1 + w), float32 weights
    qk_norm: bool = False  # per head, before RoPE
    gelu: bool = False
    window: int = 0  # sliding window (tokens), 0: none
    softcap: float = 0.0


LLAMA = Style()
QWEN3 = Style(qk_norm=True)
GEMMA = Style(sandwich=True, gemma_norm=True, qk_norm=True, gelu=True, window=5, softcap=3.0)

RAGGED = Dims(40, 4, 2, 10, 37)
ALIGNED = Dims(64, 4, 2, 16, 96)  # int4: every projection's output a multiple of 64, its input of 32


@dataclass
class Layer:
    tables: list[torch.Tensor | None]  # input, post-attention, pre-ff, post-ff, q, k norms; RoPE cos, sin
    projs: list[nn.Module]  # qkv, o, gate_up, down: nn.Linear, Int8Linear or Int4Linear
    weights: list[torch.Tensor]  # what each projection multiplies by, float64
    biases: list[torch.Tensor | None]
    params: tuple[float, int, float]  # score scale, window, soft cap


def _projection(w: torch.Tensor, b: torch.Tensor | None, kind: str, dtype: torch.dtype, ext) -> nn.Module:
    n, k = w.shape
    if kind == "plain":
        lin = nn.Linear(k, n, bias=b is not None, dtype=dtype)
        lin.weight.data.copy_(w)
    elif kind == "int8":
        lin = Int8Linear(k, n, b is not None, dtype)
        lin.quantize_rows(0, w)
    else:
        lin = Int4Linear(k, n, b is not None, dtype, 32, dequant=ext)
        lin.quantize_rows(0, w)
    if b is not None:
        lin.bias.data.copy_(b)
    return lin


def _layers(
    g: torch.Generator, d: Dims, dtype: torch.dtype, bias: bool, kind: str, ext, style: Style = LLAMA
) -> list[Layer]:
    inv = 1.0 / (10000 ** (torch.arange(0, d.head_dim, 2, dtype=torch.float64) / d.head_dim))
    angles = torch.arange(d.max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    norm_dtype = torch.float32 if style.gemma_norm else dtype

    def vec(n, base=0.0, to=dtype):
        return (base + 0.1 * torch.randn(n, generator=g)).to(to)

    def norm(n):  # Gemma's weights sit around 0 (1 + w), Llama's around 1
        return vec(n, 0.0 if style.gemma_norm else 1.0, norm_dtype)

    layers = []
    for _ in range(d.layers):
        tables = [norm(d.hidden), norm(d.hidden)]
        tables += [norm(d.hidden), norm(d.hidden)] if style.sandwich else [None, None]
        tables += [norm(d.head_dim), norm(d.head_dim)] if style.qk_norm else [None, None]
        tables += [angles.cos().to(dtype), angles.sin().to(dtype)]
        projs, weights, biases = [], [], []
        for i, (n, k) in enumerate(d.shapes):
            w = torch.randn(n, k, generator=g) / math.sqrt(k)
            b = vec(n) if bias and i < 2 else None  # Qwen2-style: biases on qkv (and o here)
            lin = _projection(w.to(dtype), b, kind, dtype, ext)
            projs.append(lin)
            weights.append((lin.weight if kind == "plain" else lin.reference_weight()).double())
            biases.append(None if b is None else b.double())
        layers.append(Layer(tables, projs, weights, biases, (d.head_dim**-0.5, style.window, style.softcap)))
    return layers


def _step(g: torch.Generator, d: Dims, lens: list[int], dtype: torch.dtype):
    """Block tables (distinct shuffled blocks per row), positions, slots and caches with context."""
    rows = len(lens)
    width = max(math.ceil(n / d.block) for n in lens) + 1
    perm = torch.randperm(d.blocks, generator=g)
    tables = torch.zeros(rows, width, dtype=torch.int32)
    used = 0
    for r, n in enumerate(lens):
        need = math.ceil(n / d.block)
        tables[r, :need] = perm[used : used + need].int()
        used += need
    positions = torch.tensor([n - 1 for n in lens], dtype=torch.long)
    slots = torch.tensor(
        [int(tables[r, p // d.block]) * d.block + p % d.block for r, p in enumerate(positions.tolist())],
        dtype=torch.long,
    )
    caches = [torch.randn(2, d.blocks, d.block, d.kv_heads, d.head_dim, generator=g).to(dtype) for _ in range(d.layers)]
    return tables, positions, slots, torch.tensor(lens, dtype=torch.int32), caches


def _reference(d: Dims, layers: list[Layer], style: Style, h, residual, caches, positions, slots, tables, lens):
    """float64 layers: h, residual after every layer; the caches (float64) get the new K/V."""
    f64 = torch.float64
    H, KVH, D, inter = d.heads, d.kv_heads, d.head_dim, d.inter
    h = h.to(f64)
    residual = None if residual is None else residual.to(f64)
    half = D // 2

    def norm(x, w):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + d.eps)
        return x * (1 + w.to(f64)) if style.gemma_norm else x * w.to(f64)

    def linear(x, i, layer):
        y = x @ layer.weights[i].t()
        return y if layer.biases[i] is None else y + layer.biases[i]

    def act(x):
        return F.gelu(x, approximate="tanh") if style.gelu else F.silu(x)

    for layer, kv in zip(layers, caches):
        n1, n2, pre_ff, post_ff, qn, kn, cos, sin = layer.tables
        scale, window, softcap = layer.params
        residual = h if residual is None else residual + h
        qkv = linear(norm(residual, n1), 0, layer)
        qk = qkv[:, : (H + KVH) * D].view(-1, H + KVH, D)
        if qn is not None:
            qk = torch.cat((norm(qk[:, :H], qn), norm(qk[:, H:], kn)), dim=1)
        c, s = cos.to(f64)[positions][:, None], sin.to(f64)[positions][:, None]
        x1, x2 = qk[..., :half], qk[..., half:]
        qk = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        q, k = qk[:, :H], qk[:, H:]
        v = qkv[:, (H + KVH) * D :].view(-1, KVH, D)
        flat = kv.view(2, -1, KVH, D)
        flat[0, slots], flat[1, slots] = k, v
        out = torch.empty(len(lens), H, D, dtype=f64)
        for r, n in enumerate(lens.tolist()):
            t = torch.arange(max(0, n - window) if window else 0, n)  # a sliding layer sees (p - window, p]
            rows = tables[r, t // d.block].long() * d.block + t % d.block
            keys, values = flat[0, rows], flat[1, rows]  # [n, kv_heads, D]
            for hd in range(H):
                kvh = hd // (H // KVH)
                scores = keys[:, kvh] @ q[r, hd] * scale
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                out[r, hd] = torch.softmax(scores, dim=0) @ values[:, kvh]
        attn = linear(out.reshape(len(lens), -1), 1, layer)
        if style.sandwich:
            residual = residual + norm(attn, n2)
            gu = linear(norm(residual, pre_ff), 2, layer)
            h = norm(linear(act(gu[:, :inter]) * gu[:, inter:], 3, layer), post_ff)
        else:
            residual = residual + attn
            gu = linear(norm(residual, n2), 2, layer)
            h = linear(act(gu[:, :inter]) * gu[:, inter:], 3, layer)
    return h, residual


def _stack(ext, d: Dims, layers: list[Layer], dtype: torch.dtype, style: Style = LLAMA):
    return ext.DecodeStack(
        d.hidden,
        d.heads,
        d.kv_heads,
        d.head_dim,
        d.inter,
        d.eps,
        style.gemma_norm,
        style.gelu,
        [layer.tables for layer in layers],
        [[proj_arg(p, dtype) for p in layer.projs] for layer in layers],
        [layer.params for layer in layers],
    )


def _run(ext, d, layers, dtype, inputs, isa, first=0, last=None, style: Style = LLAMA):
    h, residual, caches, positions, slots, tables, lens = inputs
    last = d.layers if last is None else last
    caches = [c.clone() for c in caches]
    out_h, out_r = _stack(ext, d, layers, dtype, style).forward(
        first, last, h, residual, caches[first:last], positions, slots, tables, lens, isa=isa
    )
    return out_h, out_r, caches


def _inputs(seed: int, d: Dims, lens: list[int], dtype: torch.dtype, with_residual: bool):
    g = torch.Generator().manual_seed(seed)
    tables, positions, slots, lens_t, caches = _step(g, d, lens, dtype)
    h = torch.randn(len(lens), d.hidden, generator=g).to(dtype)
    residual = torch.randn(len(lens), d.hidden, generator=g).to(dtype) if with_residual else None
    return g, (h, residual, caches, positions, slots, tables, lens_t)


CASES = [([1], False, False), ([9], True, True), ([5, 1, 12], False, True), ([3, 8, 2, 17, 6, 11], True, False)]


@pytest.mark.parametrize(
    "kind,dims,style,lens,bias,with_residual",
    [("plain", RAGGED, LLAMA, *case) for case in CASES]
    + [("int8", RAGGED, LLAMA, *case) for case in CASES[1:3]]
    + [("int4", ALIGNED, LLAMA, *case) for case in CASES[1:3]]
    + [("plain", RAGGED, QWEN3, *CASES[2]), ("plain", RAGGED, GEMMA, *CASES[3]), ("int4", ALIGNED, GEMMA, *CASES[2])],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layers_against_float64(ext, isas, kind, dims, style, lens, bias, with_residual, dtype):
    """Quantized projections against the float64 product with the weight their layer multiplies
    by (`reference_weight()`): the same tolerance as plain ones, only the rounding differs."""
    g, inputs = _inputs(len(lens) * 7 + bias, dims, lens, dtype, with_residual)
    layers = _layers(g, dims, dtype, bias, kind, ext, style)
    h, residual, caches, positions, slots, tables, lens_t = inputs
    want_caches = [c.double() for c in caches]
    want_h, want_r = _reference(dims, layers, style, h, residual, want_caches, positions, slots, tables, lens_t)
    # float32: summation order only; bf16: every op's result rounded to bf16 (2^-8) along two layers
    rtol, atol = (1e-4, 1e-4) if dtype == torch.float32 else (6e-2, 6e-2)
    width = dims.kv_heads * dims.head_dim
    for isa in isas:
        got_h, got_r, got_caches = _run(ext, dims, layers, dtype, inputs, isa, style=style)
        assert got_h.dtype == got_r.dtype == dtype
        torch.testing.assert_close(got_h.double(), want_h, rtol=rtol, atol=atol, msg=lambda m: f"{isa} h: {m}")
        torch.testing.assert_close(got_r.double(), want_r, rtol=rtol, atol=atol, msg=lambda m: f"{isa} residual: {m}")
        for got, want in zip(got_caches, want_caches):  # the new K/V at the slots, the rest untouched
            flat_got, flat_want = got.double().view(2, -1, width), want.view(2, -1, width)
            torch.testing.assert_close(flat_got, flat_want, rtol=rtol, atol=atol, msg=lambda m: f"{isa} cache: {m}")


def test_a_range_of_layers_runs_those_layers_only(ext, isas):
    """Layers [1, 2) of the stack: the same as a one-layer stack of layer 1."""
    g, inputs = _inputs(3, RAGGED, [4, 9], torch.float32, True)
    layers = _layers(g, RAGGED, torch.float32, False, "plain", ext)
    h, residual, caches, positions, slots, tables, lens_t = inputs
    got_h, got_r, got_caches = _run(ext, RAGGED, layers, torch.float32, inputs, isas[-1], first=1, last=2)
    want_caches = [caches[1].double()]
    want_h, want_r = _reference(RAGGED, layers[1:], LLAMA, h, residual, want_caches, positions, slots, tables, lens_t)
    torch.testing.assert_close(got_h.double(), want_h, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_r.double(), want_r, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_caches[1].double(), want_caches[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(got_caches[0], caches[0])  # layer 0's cache is not touched


@pytest.mark.parametrize(
    "kind,dims,style",
    [("plain", RAGGED, LLAMA), ("int8", RAGGED, LLAMA), ("int4", ALIGNED, LLAMA), ("plain", RAGGED, GEMMA)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_forced_equals_avx512(ext, isas, kind, dims, style, dtype):
    """The AVX2 path (what an AVX2-only CPU runs) against the AVX-512 one on this machine (on an
    AVX2-only CPU: the scalar path against AVX2). Equal up to summation order: the GEMVs and
    dot products sum 8-wide vectors instead of 16-wide ones."""
    pair = ("avx2", "avx512") if "avx512" in isas else ("scalar", "avx2")
    if pair[1] not in isas:
        pytest.skip("no vector path on this CPU")
    g, inputs = _inputs(11, dims, [7, 1, 20], dtype, True)
    layers = _layers(g, dims, dtype, True, kind, ext, style)
    a = _run(ext, dims, layers, dtype, inputs, pair[0], style=style)
    b = _run(ext, dims, layers, dtype, inputs, pair[1], style=style)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: a sum that lands on the other side of a rounding
    for x, y in zip(a[:2] + tuple(a[2]), b[:2] + tuple(b[2])):
        torch.testing.assert_close(x.double(), y.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", ["plain", "int8", "int4"])
def test_two_threads_split_the_rows_with_the_same_result(ext, isas, kind):
    """The projections split their output rows over torch's threads (`at::parallel_for`, 32 rows a
    task at least): each row is computed whole by one thread, so 2 threads give bit-for-bit the
    1-thread result. The engine-level tests run 1 thread beside the suite's other worker."""
    g, inputs = _inputs(5, ALIGNED, [7, 1, 20], torch.float32, True)
    layers = _layers(g, ALIGNED, torch.float32, True, kind, ext)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(ext, ALIGNED, layers, torch.float32, inputs, isas[-1])
        torch.set_num_threads(2)
        two = _run(ext, ALIGNED, layers, torch.float32, inputs, isas[-1])
    finally:
        torch.set_num_threads(threads)
    for x, y in zip(one[:2] + tuple(one[2]), two[:2] + tuple(two[2])):
        assert torch.equal(x, y)


def test_bad_arguments_are_refused(ext):
    d = RAGGED
    g, inputs = _inputs(5, d, [3], torch.float32, False)
    layers = _layers(g, d, torch.float32, False, "plain", ext)
    h, residual, caches, positions, slots, tables, lens_t = inputs
    stack = _stack(ext, d, layers, torch.float32)
    assert stack.num_layers == d.layers
    with pytest.raises(RuntimeError, match="one KV cache per layer"):
        stack.forward(0, 2, h, None, caches[:1], positions, slots, tables, lens_t)
    with pytest.raises(RuntimeError, match="slot out of the KV cache"):
        stack.forward(0, 1, h, None, caches[:1], positions, slots + d.blocks * d.block, tables, lens_t)
    with pytest.raises(RuntimeError, match="position past the RoPE table"):
        stack.forward(0, 1, h, None, caches[:1], positions + d.max_pos, slots, tables, lens_t)
    with pytest.raises(RuntimeError, match="model dtype"):
        stack.forward(0, 1, h.bfloat16(), None, caches[:1], positions, slots, tables, lens_t)
    tables_ = [layer.tables for layer in layers]
    projs = [[proj_arg(p, torch.float32) for p in layer.projs] for layer in layers]
    params = [layer.params for layer in layers]

    def build(tables=tables_, projs=projs, params=params, gemma_norm=False):
        return ext.DecodeStack(
            d.hidden, d.heads, d.kv_heads, d.head_dim, d.inter, d.eps, gemma_norm, False, tables, projs, params
        )

    cut = [list(p) for p in projs]
    cut[1][0] = (0, projs[1][0][1][:-1], *projs[1][0][2:])
    with pytest.raises(RuntimeError, match="layer 1, projection 0: weight"):
        build(projs=cut)
    int8 = [list(p) for p in projs]
    int8[0][3] = (1, projs[0][3][1].to(torch.int8), None, None, None, 0, 0)
    with pytest.raises(RuntimeError, match="layer 0, projection 3: int8 needs a scale"):
        build(projs=int8)
    unknown = [list(p) for p in projs]
    unknown[0][2] = (7, *projs[0][2][1:])
    with pytest.raises(RuntimeError, match="kind must be 0"):
        build(projs=unknown)
    with pytest.raises(RuntimeError, match="layer 0: table 0 must be"):  # norms in the model dtype
        build(tables=[[t.bfloat16() if i == 0 else t for i, t in enumerate(ts)] for ts in tables_])
    half_pair = [list(ts) for ts in tables_]
    half_pair[1][4] = half_pair[1][0][: d.head_dim]
    with pytest.raises(RuntimeError, match="come in pairs"):
        build(tables=half_pair)
    with pytest.raises(RuntimeError, match="window and softcap must be >= 0"):
        build(params=[(p[0], -1, 0.0) for p in params])
