"""Load a model directory (config.json + safetensors) and size/allocate its KV cache.

Weights load through safetensors only: pickle-based checkpoints (.bin, .pt, .pth, .ckpt) are
refused, never opened.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pagedserve.engine.attention.backend import AttentionBackend
from pagedserve.engine.attention.kv_dtype import KVCacheDtype, kv_row_width
from pagedserve.engine.attention.kv_quant import kv_storage_dtype
from pagedserve.engine.config.engine import resolve_dtype
from pagedserve.engine.kv_cache.groups import KVCacheLayout
from pagedserve.engine.model.causal_lm import CausalLM
from pagedserve.engine.model.fused_decode import build_fused_decode
from pagedserve.engine.model.kv_pool_size import as_spec
from pagedserve.engine.model.quant_spec import QuantSpec
from pagedserve.engine.model.registry import family_of, parse_config
from pagedserve.kernels.cpu_fused_ops import CpuFusedOps, load_fused_ops
from pagedserve.kernels.cpu_isa import cpu_has_bf16_dot
from pagedserve.kernels.cpu_packed_linear import PackedLinear, SharedWeightLinear, packed_linear_supported
from pagedserve.kernels.cpu_upcast_linear import UpcastLinear, load_gemv

if TYPE_CHECKING:
    from pagedserve.engine.model.layers.parallel import RankGroup

_INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def read_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those named by the index file when present, else all."""
    model_dir = Path(model_dir)
    index = model_dir / _INDEX_FILE
    if index.is_file():
        with index.open(encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [str(p.name) for p in files if not p.is_file()]
        if absent:
            raise FileNotFoundError(f"{_INDEX_FILE} names missing files: {', '.join(absent)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for p in model_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickled:
        raise ValueError(
            f"{model_dir} holds only pickle checkpoints ({', '.join(pickled)}); pagedserve loads "
            "safetensors only. Convert them first, e.g. transformers' save_pretrained(..., "
            "safe_serialization=True) in a trusted environment."
        )
    raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one tensor at a time, on CPU, in the checkpoint's dtype.

    Each tensor is read with plain file reads into a buffer of its own (freed once the model has
    copied it), in file order: a memory-mapped shard (safetensors' `safe_open`) keeps every page
    it has read resident in the process until it is closed, which added up to a shard's size
    (~460 MiB on a 1B model's 500 MB shards) to the loading peak. Reading tensor by tensor, the
    peak is the loaded model plus the tensor being copied."""
    for path in files:
        with open(path, "rb") as f:
            header = _safetensors_header(f, path)
            start = f.tell()
            entries = sorted(
                ((name, info) for name, info in header.items() if name != "__metadata__"),
                key=lambda item: item[1]["data_offsets"][0],
            )
            for name, info in entries:
                yield name, _read_tensor(f, start, name, info, path)


def _safetensors_header(f, path: Path) -> dict[str, Any]:
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError(f"{path.name} is not a safetensors file (shorter than its header length)")
    (length,) = struct.unpack("<Q", raw)
    if length > _MAX_HEADER_BYTES:
        raise ValueError(f"{path.name}: safetensors header of {length} bytes, more than {_MAX_HEADER_BYTES}")
    try:
        header = json.loads(f.read(length))
    except ValueError as exc:
        raise ValueError(f"{path.name}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: unreadable safetensors header (not a JSON object)")
    return header


def _read_tensor(f, start: int, name: str, info: dict[str, Any], path: Path) -> torch.Tensor:
    dtype = _ST_DTYPES.get(str(info.get("dtype")))
    if dtype is None:
        raise ValueError(f"{path.name}: tensor {name} has unsupported dtype {info.get('dtype')!r}")
    shape = [int(d) for d in info["shape"]]
    begin, end = (int(x) for x in info["data_offsets"])
    count = math.prod(shape)
    if end - begin != count * dtype.itemsize or begin < 0:
        raise ValueError(f"{path.name}: tensor {name} spans {end - begin} bytes, expected {count * dtype.itemsize}")
    buf = torch.empty(end - begin, dtype=torch.uint8)
    f.seek(start + begin)
    view, done = buf.numpy().data, 0  # a writable memoryview of the buffer
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise ValueError(f"{path.name}: tensor {name} is cut short (file truncated)")
        done += n
    return buf.view(dtype).view(shape)


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype,
    device: str | torch.device,
    backend: AttentionBackend,
    max_model_len: int | None = None,
    fused_ops: CpuFusedOps | None = None,
    quant: QuantSpec | None = None,
    pack_linear: bool = True,
    tp: RankGroup | None = None,
) -> CausalLM:
    """Build the model from `model_dir/config.json` and fill it from its safetensors files.

    `pack_linear`: on CPU in bfloat16, swap the projections for packed or upcasting layers
    (`pack_linear_weights`); a model for torch.compile keeps plain nn.Linear weights, which
    inductor freezes and packs itself.
    Raises ValueError for an unsupported architecture/config, a missing or unexpected tensor,
    a shape mismatch, or a directory with only pickle checkpoints. `quant` (see
    `pagedserve.engine.model.quant_spec.resolve_spec`) loads quantized layers, tensor by tensor. `tp`: this
    process's rank of a tensor-parallel group; only its shard is built and read (pagedserve.engine.parallel).
    """
    config = read_config(model_dir)
    files = safetensors_files(model_dir)
    spec = parse_config(config)
    model = family_of(spec).load_model_class()(
        spec,
        resolve_dtype(dtype),
        device,
        backend,
        max_model_len=max_model_len,
        fused_ops=fused_ops,
        quant=quant,
        tp=tp,
    )
    if tp is None:
        model.load_weights(iter_safetensors(files))
    else:
        from pagedserve.engine.model.sharding import iter_rank_tensors

        model.load_weights(iter_rank_tensors(files, model.spec, tp.rank, tp.size))
    model.fused_decode = build_fused_decode(model)
    if pack_linear and model.dtype == torch.bfloat16 and model.device.type == "cpu":
        if not cpu_has_bf16_dot():  # UpcastLinear keeps the plain weight the fused layers share
            model.pack_linear_weights(functools.partial(UpcastLinear, gemv=load_gemv()))
        elif packed_linear_supported():
            fused = model.fused_decode
            # A tied head reads the embedding's table: a packed copy would double the table.
            model.pack_linear_weights(
                PackedLinear,
                keep_plain=None if fused is None else fused.holds,
                make_tied=functools.partial(SharedWeightLinear, gemv=load_gemv()),
            )
    return model.eval()


def allocate_kv_caches(
    config: Any,
    num_blocks: int,
    block_size: int,
    dtype: str | torch.dtype,
    device: str | torch.device,
    kv_dtype: KVCacheDtype = KVCacheDtype.AUTO,
    layout: KVCacheLayout | None = None,
) -> list[torch.Tensor]:
    """One zero-filled `[2, num_blocks, block_size, kv_heads, head_dim]` tensor per layer (a
    quantized `kv_dtype`: uint8 rows of `head_dim + 2`, see pagedserve.engine.attention.kv_quant).
    With a `layout`: its `num_tensors` tensors, layer i given the one of `tensor_of_layer()[i]`
    (layers of different KV cache groups share a tensor; their block ids never overlap)."""
    spec = as_spec(config)
    shape = (2, num_blocks, block_size, spec.num_kv_heads, kv_row_width(spec.head_dim, kv_dtype))
    storage = kv_storage_dtype(kv_dtype, resolve_dtype(dtype))
    if layout is None:
        return [torch.zeros(shape, dtype=storage, device=device) for _ in range(spec.num_layers)]
    tensors = [torch.zeros(shape, dtype=storage, device=device) for _ in range(layout.num_tensors)]
    return [tensors[j] for j in layout.tensor_of_layer()]


def select_fused_ops(device: str | torch.device, dtype: torch.dtype):
    """The fused elementwise ops for the model on `device` (CPU, float32/bfloat16), else None."""
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    return load_fused_ops()
