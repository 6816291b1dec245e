"""Batched gather-matmul for LoRA (the punica BGMV idea): each token row with its own adapter.

    out[t, n] (+)= sum_k x[t, k] * W[idx[t]][n, k]          (rows with idx[t] < 0 are skipped)

`W` is a stack of per-adapter matrices addressed by strides, so the same kernel serves both
halves of a LoRA product over the engine's stacked slots (see pagedserve.engine.lora.slots):

- shrink: `W = A` viewed as `[S, R, K]` (slot s owns rows `[s*R, (s+1)*R)` of A `[S*R, K]`):
  strides (R*K, K, 1); out `[T, R]` is overwritten (rows without an adapter get 0);
- expand: `W = B` viewed as `[S, N, R]` (slot s owns columns `[s*R, (s+1)*R)` of B `[N, S*R]`):
  strides (R, S*R, 1); out `[T, N]` is accumulated into (the base projection's output).

One program computes a `BLOCK_N` slice of one token row, walking K in `BLOCK_K` chunks with a
float32 accumulator. Loads are upcast to float32 before the products (exact in the interpreter,
where bf16 reductions are wrong: triton-lang/triton#11584; on a GPU this costs nothing at LoRA's
tiny ranks). Without a GPU the kernel runs only under `TRITON_INTERPRET=1`, for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _bgmv_kernel(
    out_ptr,
    x_ptr,
    w_ptr,
    idx_ptr,
    N,
    K,
    stride_x_t,
    stride_o_t,
    stride_w_s,
    stride_w_n,
    stride_w_k,
    ACCUMULATE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0)
    nb = tl.program_id(1)
    slot = tl.load(idx_ptr + t)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if slot >= 0:
        w_base = w_ptr + slot.to(tl.int64) * stride_w_s
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(x_ptr + t * stride_x_t + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            w = tl.load(
                w_base + offs_n[:, None] * stride_w_n + offs_k[None, :] * stride_w_k,
                mask=mask_n[:, None] & mask_k[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
    out_ptrs = out_ptr + t * stride_o_t + offs_n
    if ACCUMULATE:
        if slot >= 0:
            prev = tl.load(out_ptrs, mask=mask_n, other=0.0).to(tl.float32)
            tl.store(out_ptrs, (prev + acc).to(out_ptr.dtype.element_ty), mask=mask_n)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def _check(x: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
    if x.dim() != 2 or out.dim() != 2 or x.shape[0] != out.shape[0] or idx.shape != (x.shape[0],):
        raise ValueError(f"bad shapes: x {tuple(x.shape)}, idx {tuple(idx.shape)}, out {tuple(out.shape)}")
    if x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("x and out need contiguous rows")
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx must be int32 or int64, got {idx.dtype}")
    if x.device != out.device or x.device != idx.device:
        raise ValueError("x, idx and out must be on one device")


def _launch(out, x, w, idx, n, k, strides, accumulate: bool) -> torch.Tensor:
    _check(x, idx, out)
    if w.device != x.device:
        raise ValueError("w must be on x's device")
    if x.shape[0] == 0:
        return out
    block_n = min(64, triton.next_power_of_2(n))
    block_k = min(64, triton.next_power_of_2(k))
    grid = (x.shape[0], triton.cdiv(n, block_n))
    _bgmv_kernel[grid](
        out,
        x,
        w,
        idx,
        n,
        k,
        x.stride(0),
        out.stride(0),
        *strides,
        ACCUMULATE=accumulate,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out


def bgmv_shrink(x: torch.Tensor, a: torch.Tensor, idx: torch.Tensor, rank: int) -> torch.Tensor:
    """`x [T, K]`, `a [S*rank, K]` -> `[T, rank]`: row t is `x[t] @ a[idx[t]*rank : ...].T` (0 if idx < 0)."""
    if a.dim() != 2 or a.shape[1] != x.shape[1] or a.shape[0] % rank or a.stride(1) != 1:
        raise ValueError(f"a must be [S*{rank}, {x.shape[1]}] with contiguous rows, got {tuple(a.shape)}")
    out = torch.empty(x.shape[0], rank, dtype=x.dtype, device=x.device)
    return _launch(out, x, a, idx, rank, x.shape[1], (rank * a.stride(0), a.stride(0), 1), accumulate=False)


def bgmv_expand(y: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out[t] += y[t] @ b[:, idx[t]*R : (idx[t]+1)*R].T` for `y [T, R]`, `b [N, S*R]` (skipped if idx < 0)."""
    rank = y.shape[1]
    if b.dim() != 2 or b.shape[0] != out.shape[1] or b.shape[1] % rank or b.stride(1) != 1:
        raise ValueError(f"b must be [{out.shape[1]}, S*{rank}] with contiguous rows, got {tuple(b.shape)}")
    return _launch(out, y, b, idx, out.shape[1], rank, (rank, b.stride(0), 1), accumulate=True)


def bgmv_reference(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, rank: int, out: torch.Tensor
) -> torch.Tensor:
    """Plain torch, one row at a time, in float32: `out[t] + (x[t] @ A_s.T) @ B_s.T` with
    `A_s = a[s*rank:(s+1)*rank]`, `B_s = b[:, s*rank:(s+1)*rank]`, s = idx[t]; a new tensor."""
    result = out.float().clone()
    for t, s in enumerate(idx.tolist()):
        if s >= 0:
            a_s, b_s = a[s * rank : (s + 1) * rank].float(), b[:, s * rank : (s + 1) * rank].float()
            result[t] += (x[t].float() @ a_s.T) @ b_s.T
    return result.to(out.dtype)
