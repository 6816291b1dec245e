"""pagedserve's engine: paged KV cache, token-budget scheduler, model runner, offline API.

`from pagedserve.engine import LLM, SamplingParams` works, but importing the package (or any submodule,
such as `pagedserve.engine.kv_cache.block_pool`) loads nothing else: the names below are imported on first
access (PEP 562), so a light module never pays for torch, the model code or transformers.
"""

from __future__ import annotations

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LoRARequest", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from pagedserve.engine.llm import LLM

        return LLM
    if name == "EngineConfig":
        from pagedserve.engine.config.engine import EngineConfig

        return EngineConfig
    if name == "SamplingParams":
        from pagedserve.engine.sampling.params import SamplingParams

        return SamplingParams
    if name == "LoRARequest":
        from pagedserve.engine.lora.request import LoRARequest

        return LoRARequest
    if name in ("CompletionOutput", "RequestOutput"):
        from pagedserve.engine.request import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__ + ["__getattr__"])
