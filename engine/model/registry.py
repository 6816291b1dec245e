"""The one list of supported model families, and the look-ups built on it.

Each family lives in its own file (engine/model/<family>.py) and declares a `Family`
(pagedserve.engine.model.family): the HF architectures it serves, its config parser and the name
of its model class (in causal_lm or moe_lm, imported only when a model is built: this module
and the family files import no torch).
Everything that asks "is this model supported, and how is it built" asks here: the loader, the
archive checks, `GET /models/{name}` and `pagedserve --help`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedserve.engine.model.family import Family
from pagedserve.engine.model.gemma2 import GEMMA2
from pagedserve.engine.model.gemma3 import GEMMA3
from pagedserve.engine.model.llama import LLAMA, MISTRAL, QWEN2
from pagedserve.engine.model.mixtral import MIXTRAL
from pagedserve.engine.model.olmoe import OLMOE
from pagedserve.engine.model.phi3 import PHI3
from pagedserve.engine.model.qwen2_moe import QWEN2_MOE
from pagedserve.engine.model.qwen3 import QWEN3
from pagedserve.engine.model.qwen3_moe import QWEN3_MOE
from pagedserve.engine.model.spec import SUPPORTED_ROPE_TYPES, ModelSpec, as_dict

FAMILIES: tuple[Family, ...] = (
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
    GEMMA2,
    GEMMA3,
    PHI3,
    QWEN2_MOE,
    QWEN3_MOE,
    MIXTRAL,
    OLMOE,
)
# GGML tensor types a GGUF may hold (de-quantized at load by the gguf package through
# transformers, pagedserve.engine.model.convert); any other type is refused by name.
SUPPORTED_GGUF_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)


def supported_architectures() -> tuple[str, ...]:
    return tuple(arch for family in FAMILIES for arch in family.architectures)


def supported_gguf_architectures() -> tuple[str, ...]:
    return tuple(arch for family in FAMILIES for arch in family.gguf_architectures)


def describe_support() -> str:
    """One line per family, for `pagedserve --help` and the docs."""
    lines = [f"  {f.name}: {', '.join(f.architectures)}" + (f" ({f.notes})" if f.notes else "") for f in FAMILIES]
    return "\n".join(
        lines
        + [
            f"  rope types: {', '.join(SUPPORTED_ROPE_TYPES)}",
            f"  GGUF architectures: {', '.join(supported_gguf_architectures())}",
            f"  GGUF tensor types (de-quantized at load): {', '.join(SUPPORTED_GGUF_TYPES)}",
        ]
    )


def _by_architecture() -> dict[str, Family]:
    return {arch: family for family in FAMILIES for arch in family.architectures}


def architecture_of(config: Mapping[str, Any]) -> str:
    """The one supported architecture named by `architectures` (or `model_type`), else ValueError
    naming it and listing what is supported."""
    names = list(config.get("architectures") or [])
    if not names:
        names = [f.architectures[0] for f in FAMILIES if config.get("model_type") in f.model_types]
    if len(names) != 1 or names[0] not in _by_architecture():
        found = ", ".join(names) or f"model_type {config.get('model_type')!r}"
        raise ValueError(f"unsupported architecture {found}; supported: {', '.join(supported_architectures())}")
    return names[0]


def family_of(config: Any) -> Family:
    """The family serving an HF config (dict or PretrainedConfig), or a ModelSpec's."""
    if isinstance(config, ModelSpec):
        return _by_architecture()[config.architecture]
    return _by_architecture()[architecture_of(as_dict(config))]


def check_tensor_parallel_support(spec: ModelSpec, size: int) -> None:
    """ValueError when `size` > 1 ranks are asked of a family whose checkpoint names the
    sharding (pagedserve.engine.model.sharding) does not cover."""
    if size > 1 and not family_of(spec).tensor_parallel:
        names = ", ".join(a for f in FAMILIES if f.tensor_parallel for a in f.architectures)
        raise ValueError(f"tensor parallelism is not supported for {spec.architecture}; supported: {names}")


def parse_config(config: Any) -> ModelSpec:
    """An HF config parsed by its family; ValueError on anything not supported."""
    cfg = as_dict(config)
    arch = architecture_of(cfg)
    return _by_architecture()[arch].parse(cfg, arch)
