"""Old import path of the model spec, kept for code written before the family registry:
`LlamaSpec` is `pagedserve.engine.model.spec.ModelSpec`, `architecture_of` is the registry's."""

from __future__ import annotations

from pagedserve.engine.model.layers.rotary import rope_inv_freq
from pagedserve.engine.model.registry import architecture_of, supported_architectures
from pagedserve.engine.model.spec import SUPPORTED_ROPE_TYPES, ModelSpec

LlamaSpec = ModelSpec
SUPPORTED_ARCHITECTURES = supported_architectures()

__all__ = ["LlamaSpec", "SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "architecture_of", "rope_inv_freq"]
