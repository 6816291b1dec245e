"""pagedserve's engine: paged KV cache, token-budget scheduler, model runner, offline API."""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "RequestOutput", "SamplingParams"]
