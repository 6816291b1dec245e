"""Which layers of a model are quantized, and how: the `quantization` option and a checkpoint's record.

What is quantized (every mode but `none`): the seven projections of every decoder layer (as the
fused `qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`) take the mode's layout; the token
embedding becomes int8 rows (`Int8Embedding`) and the LM head an `Int8Linear` (over the same
storage when the embeddings are tied). Norms stay in the model dtype.

A quantized checkpoint (written by `pagedserve archive --quantize` or from a GGUF) records this
in config.json under `pagedserve_quantization`: `{"method", "group_size", "source",
"overrides": {fused module name: method}}`; its tensors are `<proj>.qweight` (int8 `[N, K]`, or
uint8 `[N, K / 2]` int4 codes two per byte), `<proj>.scales` (float32 `[N]` or `[N, groups]`)
and, for int4, `<proj>.offsets` (float32 `[N, groups]`): `w = code * scale + offset`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pagedserve.kernels.cpu_isa import cpu_has_vnni

INT4_GROUP_SIZES = (32, 64, 128)


class QuantMethod(enum.Enum):
    """The quantized layers' layout (pagedserve.engine.model.quant_linear holds the layers)."""

    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"
    W8A8 = "w8a8"


CONFIG_KEY = "pagedserve_quantization"
QUANT_LEAVES = ("qweight", "scales", "offsets")


@dataclass(slots=True)
class QuantSpec:
    method: QuantMethod
    group_size: int = 32
    source: str = ""  # what the weights were quantized from, e.g. "gguf Q4_1" or "float32 checkpoint"
    overrides: dict[str, QuantMethod] = field(default_factory=dict)  # fused module name -> method

    def __post_init__(self) -> None:
        self.method = parse_method(self.method)
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"quantization group size must be one of {INT4_GROUP_SIZES}, got {self.group_size}")
        self.overrides = {k: parse_method(v) for k, v in self.overrides.items()}

    def method_for(self, module_name: str) -> QuantMethod:
        return self.overrides.get(module_name, self.method)

    def record(self) -> dict[str, Any]:
        return {
            "method": self.method.value,
            "group_size": self.group_size,
            "source": self.source,
            "overrides": {k: v.value for k, v in sorted(self.overrides.items())},
        }


def parse_method(value: Any) -> QuantMethod:
    if isinstance(value, QuantMethod):
        return value
    try:
        return QuantMethod(str(value).lower())
    except ValueError:
        raise ValueError(f"quantization={value!r}: choose one of {[m.value for m in QuantMethod]}") from None


def checkpoint_spec(config: dict[str, Any]) -> QuantSpec | None:
    """The quantization a model directory's config.json records, else None."""
    record = config.get(CONFIG_KEY)
    if record is None:
        return None
    if not isinstance(record, dict) or "method" not in record:
        raise ValueError(f"config.json: {CONFIG_KEY} must be an object with a 'method'")
    return QuantSpec(
        record["method"],
        int(record.get("group_size", 32)),
        str(record.get("source", "")),
        dict(record.get("overrides", {})),
    )


def resolve_spec(config: dict[str, Any], option: str | None, group_size: int, device: str) -> QuantSpec | None:
    """The quantization to load with: the engine option checked against the checkpoint's own.

    `option` None loads the checkpoint as it is. A quantized checkpoint refuses any other mode
    (its full-precision weights are gone); a plain one is quantized at load as asked.
    """
    stored = checkpoint_spec(config)
    wanted = None if option is None else parse_method(option)
    if stored is not None:
        if wanted is not None and (
            wanted is not stored.method or group_size != stored.group_size and wanted is QuantMethod.INT4
        ):
            raise ValueError(
                f"the model is already quantized ({stored.method.value}"
                f"{f', group size {stored.group_size}' if stored.method is QuantMethod.INT4 else ''}"
                f", from {stored.source or 'unknown'}); quantization={option!r}"
                f"{f' with group size {group_size}' if wanted is QuantMethod.INT4 else ''} "
                "contradicts it: leave quantization unset or archive the unquantized model"
            )
        spec = stored
    elif wanted is None or wanted is QuantMethod.NONE:
        return None
    else:
        spec = QuantSpec(wanted, group_size, "quantized at load")
    check_supported(spec, device)
    return spec


def check_supported(spec: QuantSpec, device: str) -> None:
    if not str(device).startswith("cpu"):
        raise ValueError(
            f"quantization={spec.method.value} runs on CPU only in this version; "
            "use device='cpu' or quantization='none'"
        )
    if QuantMethod.W8A8 in {spec.method, *spec.overrides.values()} and not cpu_has_vnni():
        raise ValueError(
            "quantization='w8a8' needs a CPU with VNNI int8 dot products (avx512_vnni, "
            "avx_vnni or AMX), which this CPU does not report; use 'int8' or 'int4' "
            "(weight-only) instead"
        )
