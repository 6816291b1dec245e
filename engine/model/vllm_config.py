"""model-config.yaml files written for TorchServe's `vllm_handler`, read as pagedserve's.

TorchServe's vLLM example archives carry::

    minWorkers: 1
    maxWorkers: 1
    maxBatchDelay: 100          # TorchServe frontend keys pagedserve has no use for
    asyncCommunication: true
    handler:
        model_path: "model/models--org--name/snapshots/<sha>"
        vllm_engine_config:
            max_num_seqs: 16
            max_model_len: 250
            served_model_name: ["org/name"]
        adapters: {...}

`translate(data)` turns that into pagedserve's shape: `vllm_engine_config`'s keys become the
`handler:` engine options of the same meaning (`VLLM_KEYS`: vLLM's name -> ours, the value
converted), keys pagedserve has no equivalent for are dropped with a warning naming each, and
so are TorchServe frontend keys that only matter to TorchServe's own batching (`IGNORED_FRONTEND`).
`model_path` is understood (the archive's model directory is found by its config.json). It
returns the translated mapping and the warnings; a file without `vllm_engine_config` or
`model_path` under `handler:` is returned unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# vLLM engine argument -> (our handler key, how its value converts; None: as it is).
_DTYPES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32", "float32": "float32"}


def _dtype(value: Any) -> Any:
    return _DTYPES.get(str(value).lower(), value)


VLLM_KEYS: dict[str, tuple[str, Callable[[Any], Any] | None]] = {
    "dtype": ("dtype", _dtype),
    "max_model_len": ("max_model_len", None),
    "max_num_seqs": ("max_num_seqs", None),
    "max_num_batched_tokens": ("max_num_batched_tokens", None),
    "block_size": ("block_size", None),
    "enable_prefix_caching": ("enable_prefix_caching", None),
    "seed": ("seed", None),
    "num_gpu_blocks_override": ("num_kv_blocks", None),
    "kv_cache_memory_bytes": ("kv_cache_memory", None),
    "scheduling_policy": ("scheduling_policy", None),
    "quantization": ("quantization", None),
    "tensor_parallel_size": ("tensor_parallel_size", None),
}
# Values that mean "the default" (or one device) in vLLM: dropped silently.
_DEFAULTS = {"dtype": "auto", "tensor_parallel_size": 1, "pipeline_parallel_size": 1}
# vLLM keys that are understood and need nothing here (the registration names the model).
_UNDERSTOOD = frozenset({"served_model_name", "model", "tokenizer"})
# TorchServe frontend keys that only shape TorchServe's own batching or process model.
IGNORED_FRONTEND = (
    "batchSize",
    "maxBatchDelay",
    "asyncCommunication",
    "continuousBatching",
    "torchrun",
    "useVenv",
    "maxRetryTimeoutInSec",
    "clientTimeoutInMills",
)
VLLM_HANDLER_KEYS = ("model_path", "vllm_engine_config", "adapters")


def is_vllm_config(data: Any) -> bool:
    handler = data.get("handler") if isinstance(data, dict) else None
    return isinstance(handler, dict) and any(k in handler for k in ("model_path", "vllm_engine_config"))


def translate(data: Any, source: str = "model-config.yaml") -> tuple[Any, list[str]]:
    """A vllm_handler model-config -> pagedserve's, and a warning per key that was dropped."""
    if not is_vllm_config(data):
        return data, []
    warnings: list[str] = []
    out = {k: v for k, v in data.items() if k != "handler"}
    for key in IGNORED_FRONTEND:
        if key in out:
            if not (key == "batchSize" and out[key] == 1):
                warnings.append(
                    f"{source}: {key} is TorchServe's batching setting; pagedserve "
                    "batches continuously in the engine (ignored)"
                )
            del out[key]
    handler = data["handler"]
    engine_config = handler.get("vllm_engine_config") or {}
    if not isinstance(engine_config, dict):
        raise ValueError(
            f"{source}: handler.vllm_engine_config: must be a mapping of vLLM engine "  # noqa: TRY004
            f"arguments, got {type(engine_config).__name__}"
        )
    options: dict[str, Any] = {k: v for k, v in handler.items() if k not in VLLM_HANDLER_KEYS}
    for key, value in engine_config.items():
        if key in _UNDERSTOOD or (key in _DEFAULTS and _DEFAULTS[key] == value):
            continue
        if key in VLLM_KEYS:
            ours, convert = VLLM_KEYS[key]
            options[ours] = convert(value) if convert else value
        else:
            warnings.append(f"{source}: handler.vllm_engine_config.{key} has no pagedserve equivalent (ignored)")
    if handler.get("adapters"):
        warnings.append(f"{source}: handler.adapters (LoRA adapters) are not served (ignored)")
    out["handler"] = options
    return out, warnings
