"""A PEFT LoRA adapter folder read into per-layer, per-projection factors, checked against the model.

PEFT writes `adapter_config.json` and `adapter_model.safetensors` whose tensors are named like
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` (`[r, in]`) and `...lora_B.weight`
(`[out, r]`). A projection's output gains `(x @ A.T) @ B.T * scaling` with `scaling =
lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora` (PEFT's definitions); the scaling is
folded into B here. Anything this engine cannot apply exactly is refused with a ValueError
naming it: DoRA, a trained bias, `modules_to_save`, embedding or LM-head adapters, per-module
rank or alpha patterns, `fan_in_fan_out`, a rank above `max_lora_rank`, a shape that does not
fit the model.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The projections an adapter may target, grouped as the model fuses them: (group, part index).
TARGETS = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])(?:\.default)?\.weight$"
)


@dataclass(frozen=True, slots=True)
class LoRAShapes:
    """What the model's projections look like: checked against every adapter tensor."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_size: int
    kv_size: int

    def in_out(self, target: str) -> tuple[int, int]:
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }[target]


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """A loaded adapter. `key` (name and content digest) identifies it in the prefix cache:
    two adapters with the same name but other weights never share KV. `factors[(layer,
    target)] = (A [r, in], B [out, r] * scaling)` in float32."""

    name: str
    path: str
    key: str
    rank: int
    scaling: float
    factors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def lora_shapes(spec) -> LoRAShapes:
    """The projection shapes of a LlamaSpec."""
    return LoRAShapes(
        spec.num_layers,
        spec.hidden_size,
        spec.intermediate_size,
        spec.num_heads * spec.head_dim,
        spec.num_kv_heads * spec.head_dim,
    )


def read_adapter_config(folder: str | Path) -> dict:
    """The adapter's config, with the options this engine cannot apply refused (ValueError)."""
    folder = Path(folder)
    path = folder / CONFIG_FILE
    if not path.is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise ValueError(f"{folder} is not a PEFT adapter folder: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights) is not supported",
        "modules_to_save": "modules_to_save (fully trained extra modules) is not supported",
        "rank_pattern": "per-module ranks (rank_pattern) are not supported",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not supported",
    }
    for key, message in refused.items():
        if config.get(key):
            raise ValueError(f"{path}: {message}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias={config['bias']!r} is not supported (only 'none')")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"{path}: r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    return config


def adapter_scaling(config: dict) -> float:
    """PEFT's scaling: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    r, alpha = config["r"], config.get("lora_alpha", config["r"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def adapter_digest(folder: str | Path) -> str:
    """SHA-256 over the adapter's config and weights files (what its prefix-cache key hashes)."""
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(Path(folder) / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def load_adapter(name: str, folder: str | Path, shapes: LoRAShapes, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT adapter folder; ValueError naming what does not fit."""
    from safetensors.torch import load_file

    config = read_adapter_config(folder)
    rank = config["r"]
    if rank > max_rank:
        raise ValueError(f"adapter {name!r} has rank {rank}, above max_lora_rank={max_rank}")
    scaling = adapter_scaling(config)
    tensors = load_file(str(Path(folder) / WEIGHTS_FILE))
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        match = _NAME.match(tensor_name)
        if match is None:
            raise ValueError(
                f"adapter {name!r}: tensor {tensor_name} is not a LoRA factor of a supported "
                f"projection ({', '.join(TARGETS)})"
            )
        layer, target, half = int(match.group(1)), match.group(2), match.group(3)
        if layer >= shapes.num_layers:
            raise ValueError(f"adapter {name!r}: {tensor_name} names layer {layer}, the model has {shapes.num_layers}")
        halves.setdefault((layer, target), {})[half] = tensor
    factors = {}
    for (layer, target), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter {name!r}: layer {layer} {target} lacks lora_{'B' if 'A' in pair else 'A'}")
        a, b = pair["A"].float(), pair["B"].float()
        in_features, out_features = shapes.in_out(target)
        if a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise ValueError(
                f"adapter {name!r}: layer {layer} {target} has factors {tuple(a.shape)} and "
                f"{tuple(b.shape)}, expected ({rank}, {in_features}) and ({out_features}, {rank})"
            )
        factors[(layer, target)] = (a.contiguous(), (b * scaling).contiguous())
    if not factors:
        raise ValueError(f"adapter {name!r} has no LoRA factors")
    key = f"{name}@{adapter_digest(folder)[:32]}"
    return LoRAAdapter(name, str(folder), key, rank, scaling, factors)
