"""Which GPUs each worker of a model version gets (TorchServe's rule, with tensor parallelism).

The devices to share are the model-config's `deviceIds` when given (each must be visible),
else every visible GPU. A worker of a version whose `parallelLevel` is N needs N devices, and
they are consecutive in that list (GPUs next to each other share the fastest links); the list is
cut into groups of N, and workers take the groups round-robin by worker index: worker i gets
group i mod (number of groups). A worker's process sees only its devices
(`CUDA_VISIBLE_DEVICES`), as cuda:0..N-1; `GET /models/{name}` shows them per worker.

Pure functions: tested without a GPU (tests/server/workers/test_devices.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from pagedserve.engine.platform.worker_start import gpu_driver_present


class DeviceAssignmentError(ValueError):
    """The configured devices cannot hold one worker's group (400 at registration)."""


def device_pool(visible: int, device_ids: Sequence[int] | None) -> list[int]:
    """The GPUs a version's workers share: `device_ids` (checked against `visible`), else all."""
    if visible < 1:
        raise DeviceAssignmentError("no GPU is visible to the server (deviceType: gpu)")
    if device_ids is None:
        return list(range(visible))
    ids = list(device_ids)
    if not ids:
        raise DeviceAssignmentError("deviceIds is empty: list the GPU indexes to use, or omit it")
    bad = [i for i in ids if not 0 <= i < visible]
    if bad:
        raise DeviceAssignmentError(f"deviceIds {bad} are not visible GPUs (0..{visible - 1})")
    if len(set(ids)) != len(ids):
        raise DeviceAssignmentError(f"deviceIds {ids} lists a GPU twice")
    return ids


def assign_devices(
    worker_index: int, visible: int, device_ids: Sequence[int] | None = None, group_size: int = 1
) -> tuple[int, ...]:
    """The GPUs (as the server sees them) of worker `worker_index` of a version."""
    if worker_index < 0:
        raise ValueError(f"worker_index must be >= 0, got {worker_index}")
    pool = device_pool(visible, device_ids)
    groups = len(pool) // group_size
    if groups == 0:
        raise DeviceAssignmentError(
            f"parallelLevel {group_size} needs {group_size} GPUs per worker; only {len(pool)} "
            f"{'are listed in deviceIds' if device_ids is not None else 'are visible'}"
        )
    start = (worker_index % groups) * group_size
    return tuple(pool[start : start + group_size])


def visible_gpus() -> int:
    """How many GPUs this process may use (torch's count; 0 without CUDA)."""
    if not gpu_driver_present():
        return 0
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_visible_devices(devices: Sequence[int], environ: dict[str, str] | None = None) -> str:
    """`CUDA_VISIBLE_DEVICES` for a worker: its devices, translated through the server's own
    CUDA_VISIBLE_DEVICES when that is set (index i of the server is its i-th listed device)."""
    env = os.environ if environ is None else environ
    outer = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if outer:
        return ",".join(outer[i] for i in devices)
    return ",".join(str(i) for i in devices)
