"""Attention backend selection: which `AttentionBackend` serves a device.

Kept apart from the interface (`pagedserve.engine.attention.backend`) so that the concrete backends can
import the interface without a cycle; they are imported here only when chosen.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch

from pagedserve.engine.attention.backend import AttentionBackend
from pagedserve.engine.attention.kv_dtype import KVCacheDtype

BACKEND_NAMES = ("auto", "torch", "triton")


def select_backend(
    device: str | torch.device,
    name: str = "auto",
    kv_dtype: KVCacheDtype = KVCacheDtype.AUTO,
    batch_invariant: bool = False,
) -> AttentionBackend:
    """The attention backend `name` for `device`, storing the KV cache as `kv_dtype`.

    `batch_invariant` (EngineConfig.batch_invariant): the torch backend that attends every query
    token alone (pagedserve.engine.attention.batch_invariant), with the compiled CPU kernel where it
    builds; not with "triton".

    "auto": the Triton kernel on CUDA (when triton is installed), the torch backend (with the
    compiled CPU decode kernel where it builds) on CPU. "triton" on a CPU needs Triton's
    interpreter (TRITON_INTERPRET=1 before anything imports the kernels): slow, for tests.
    """
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"no attention backend for device type {device.type!r}")
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")
    if batch_invariant:
        return _batch_invariant_backend(device, name, kv_dtype)
    if name == "triton" or (name == "auto" and device.type == "cuda" and _triton_installed()):
        return _triton_backend(device, kv_dtype)
    from pagedserve.engine.attention.torch_backend import TorchAttentionBackend

    if device.type == "cpu":
        from pagedserve.kernels.cpu_paged_attention import load_cpu_kernels

        return TorchAttentionBackend(cpu_kernels=load_cpu_kernels(), kv_dtype=kv_dtype)
    return TorchAttentionBackend(kv_dtype=kv_dtype)


def _batch_invariant_backend(device: torch.device, name: str, kv_dtype: KVCacheDtype) -> AttentionBackend:
    if name == "triton":
        raise ValueError("attention_backend: must be auto or torch with batch_invariant, got 'triton'")
    from pagedserve.engine.attention.batch_invariant import BatchInvariantAttentionBackend

    kernels = None
    if device.type == "cpu":
        from pagedserve.kernels.cpu_paged_attention import load_cpu_kernels

        kernels = load_cpu_kernels()
    return BatchInvariantAttentionBackend(cpu_kernels=kernels, kv_dtype=kv_dtype)


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_backend(device: torch.device, kv_dtype: KVCacheDtype) -> AttentionBackend:
    if not _triton_installed():
        raise ValueError("the triton attention backend needs the triton package")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise ValueError(
            "the triton attention backend runs on CUDA; on a CPU only in Triton's "
            "interpreter (set TRITON_INTERPRET=1; slow, for tests)"
        )
    from pagedserve.engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(kv_dtype)


def backend_for_layer(
    backend: AttentionBackend, window: int | None, softcap: float | None, plain: Callable[[], AttentionBackend]
) -> AttentionBackend:
    """The backend of a layer of one attention kind (a KV cache group's kind): `backend`, or
    `plain()` (the torch backend on the same device) for a sliding-window or soft-capped layer
    that `backend` cannot serve (Triton: Gemma 3's full layers on the kernel, its sliding ones
    on the torch path)."""
    if backend.supports_windows or (window is None and softcap is None):
        return backend
    return plain()
