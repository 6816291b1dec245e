"""What the registry knows about one model family (pagedserve.engine.model.registry holds them all)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.engine.model.causal_lm import CausalLM
    from pagedserve.engine.model.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class Family:
    """One model definition: the HF architectures it serves, how their config parses into a
    ModelSpec, and the model class built from it.

    `model_class` names the class (`module.Class` under pagedserve.engine.model: the dense ones
    in causal_lm, the mixtures of experts in moe_lm); it is imported by `load_model_class`
    when a model is built, so that the registry, which the server's front end and the archive
    CLI ask about architectures and shapes, never imports torch.

    `parse(config, architecture)` raises ValueError (naming the field) on anything the family
    does not run. `gguf_architectures`: the GGUF `general.architecture` values it loads.
    `tensor_parallel`: whether pagedserve.engine.parallel's sharding covers its checkpoint names.
    """

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    parse: Callable[[Mapping[str, Any], str], ModelSpec]
    model_class: str
    gguf_architectures: tuple[str, ...] = ()
    tensor_parallel: bool = False
    notes: str = ""

    def load_model_class(self) -> type[CausalLM]:
        module, _, name = self.model_class.rpartition(".")
        return getattr(importlib.import_module(f"pagedserve.engine.model.{module}"), name)
