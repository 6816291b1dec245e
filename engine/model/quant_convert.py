"""Write quantized model directories: from a GGUF file keeping its quantization, or by quantizing
a plain model directory (`pagedserve archive --gguf FILE` / `--quantize METHOD`).

From a GGUF (Llama architecture), tensor by tensor, never de-quantizing the whole model:
- Q4_0, Q4_1, Q4_K projections -> int4 groups of 32, **lossless** (gguf_blocks.int4_groups: the
  codes, scales and offsets reproduce gguf's de-quantized values exactly);
- Q8_0, Q6_K projections -> decoded exactly, then int8 per output channel (re-quantized: these
  types have a scale per 32 / 16 inputs, the int8 kernel one per channel);
- F32 / F16 / BF16 tensors as they are; any other type is de-quantized by the `gguf` package with
  a warning naming the tensors, then int8 per channel;
- the token embedding (and an untied output head) -> int8 per row;
- fused partners (q/k/v, gate/up) must share a layout: if one is int8, all become int8.
The Q/K rows are un-permuted from llama.cpp's rotary layout (as transformers does).

The output layout is described in pagedserve.engine.model.quant_spec.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from pagedserve.engine.model import convert
from pagedserve.engine.model.gguf_blocks import GGUFBlockType, block_type, decode, int4_groups
from pagedserve.engine.model.gguf_once import gguf_read_once
from pagedserve.engine.model.quant_linear import QuantMethod, pack_nibbles, quantize_int4, quantize_int8
from pagedserve.engine.model.quant_spec import CONFIG_KEY, QuantSpec, parse_method

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_FUSED_GROUP = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_FLOAT_TYPES = ("F32", "F16", "BF16")


def hf_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    base, _, leaf = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, index, part = base.split(".", 2)
        if part not in _LAYER_NAMES:
            raise ValueError(f"unsupported GGUF tensor {gguf_name}")
        return f"model.layers.{index}.{_LAYER_NAMES[part]}.{leaf}"
    if base not in _TOP_NAMES:
        raise ValueError(f"unsupported GGUF tensor {gguf_name}")
    return f"{_TOP_NAMES[base]}.{leaf}"


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order undoing llama.cpp's Q/K permutation (transformers' reverse_permute_weights)."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _fused_key(name: str) -> str:
    module = name.rsplit(".", 1)[0]
    parent, _, proj = module.rpartition(".")
    return f"{parent}.{_FUSED_GROUP.get(proj, proj)}"


def _is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in _PROJECTIONS


def convert_gguf_quantized(source: str | Path, dest: str | Path, *, overwrite: bool = False) -> Path:
    """Write a quantized model directory from the GGUF `source`; return `dest` (see module doc).
    The file is parsed once (pagedserve.engine.model.gguf_once)."""
    with gguf_read_once():
        return _convert_gguf_quantized(source, dest, overwrite=overwrite)


def _convert_gguf_quantized(source: str | Path, dest: str | Path, *, overwrite: bool) -> Path:
    import gguf

    source, dest = Path(source).expanduser().resolve(), Path(dest).expanduser().absolute()
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise ValueError(
            f"{source}: keeping a GGUF's quantization supports the llama architecture, "
            f"not {arch!r}; archive it de-quantized (convert_model) instead"
        )
    config = _gguf_config(source)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    kinds = {hf_name(t.name): t.tensor_type.name for t in reader.tensors}
    layout = _choose_layout(kinds)
    fallback = sorted(n for n, k in kinds.items() if k not in _FLOAT_TYPES and block_type(k) is None)
    if fallback:
        warnings.warn(
            f"{source.name}: tensors of types with no native layout here are de-quantized "
            f"by gguf, then re-quantized to int8: {', '.join(fallback[:10])}"
            f"{' ...' if len(fallback) > 10 else ''}",
            stacklevel=2,
        )
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name, kind = hf_name(t.name), t.tensor_type.name
        raw = torch.from_numpy(t.data.copy())  # quantized: uint8 [rows, bytes per row]
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            raw = raw[_unpermute_rows(raw.shape[0], heads if "q_proj" in name else kv_heads)]
        base = name.removesuffix(".weight")
        if not (_is_projection(name) or name in ("model.embed_tokens.weight", "lm_head.weight")):
            tensors[name] = _float(raw, kind, t)
        elif layout.get(_fused_key(name)) is QuantMethod.INT4:
            codes, scale, offset = int4_groups(raw, GGUFBlockType(kind))
            tensors.update({f"{base}.qweight": pack_nibbles(codes), f"{base}.scales": scale, f"{base}.offsets": offset})
        else:
            q, scale = quantize_int8(_float(raw, kind, t))
            tensors.update({f"{base}.qweight": q, f"{base}.scales": scale})
    main = QuantMethod.INT4 if QuantMethod.INT4 in layout.values() else QuantMethod.INT8
    types = sorted(set(kinds.values()) - set(_FLOAT_TYPES))
    spec = QuantSpec(
        main, 32, f"gguf {'+'.join(types)} ({source.name})", {k: v for k, v in layout.items() if v is not main}
    )
    return _write_dir(dest, config, spec, tensors, overwrite, tokenizer_from=source, sources=[source])


def _choose_layout(kinds: dict[str, str]) -> dict[str, QuantMethod]:
    """Fused projection -> INT4 when every shard is a 4-bit type, else INT8."""
    layout: dict[str, QuantMethod] = {}
    for name, kind in kinds.items():
        if not _is_projection(name):
            continue
        bt = block_type(kind)
        method = QuantMethod.INT4 if bt is not None and bt.is_int4 else QuantMethod.INT8
        key = _fused_key(name)
        layout[key] = QuantMethod.INT8 if layout.get(key) is QuantMethod.INT8 else method
    return layout


def _float(raw: torch.Tensor, kind: str, tensor: Any) -> torch.Tensor:
    """A tensor's values as float32 (decoded here, or by gguf for types without a decoder)."""
    import gguf
    import numpy as np

    if kind in _FLOAT_TYPES:
        return raw.float() if kind != "BF16" else raw.view(torch.bfloat16).float()
    bt = block_type(kind)
    if bt is not None:
        return decode(raw, bt)
    try:
        values = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[kind])
    except (NotImplementedError, KeyError):
        raise ValueError(
            f"GGUF tensor {tensor.name}: type {kind} has no decoder here or in the gguf package "
            f"(native: {', '.join(t.value for t in GGUFBlockType)}; F32/F16/BF16; other types "
            "gguf de-quantizes); re-quantize the file with llama.cpp to one of those"
        ) from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(raw.shape[0], -1)


def quantize_model_dir(
    source: str | Path, dest: str | Path, method: str | QuantMethod, group_size: int = 32, *, overwrite: bool = False
) -> Path:
    """Write `dest`, a copy of the plain model directory `source` with its projections quantized
    (`int8`, `int4` with `group_size`, or `w8a8`), its embedding / LM head int8; tensor by tensor."""
    from pagedserve.engine.model.loader import iter_safetensors, read_config, safetensors_files

    source, dest = Path(source).expanduser().resolve(), Path(dest).expanduser().absolute()
    method = parse_method(method)
    if method is QuantMethod.NONE:
        raise ValueError("quantize_model_dir needs a method other than 'none'")
    config = read_config(source)
    if CONFIG_KEY in config:
        raise ValueError(f"{source} is already quantized ({config[CONFIG_KEY].get('method')})")
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in iter_safetensors(safetensors_files(source)):
        base = name.removesuffix(".weight")
        if method is QuantMethod.INT4 and _is_projection(name):
            codes, scale, offset = quantize_int4(tensor, group_size)
            tensors.update({f"{base}.qweight": pack_nibbles(codes), f"{base}.scales": scale, f"{base}.offsets": offset})
        elif _is_projection(name) or name in ("model.embed_tokens.weight", "lm_head.weight"):
            q, scale = quantize_int8(tensor)
            tensors.update({f"{base}.qweight": q, f"{base}.scales": scale})
        else:
            tensors[name] = tensor
    spec = QuantSpec(method, group_size, f"{config.get('dtype', config.get('torch_dtype', 'float'))} checkpoint")
    return _write_dir(
        dest,
        config,
        spec,
        tensors,
        overwrite,
        tokenizer_from=source,
        sources=[source / "config.json", *safetensors_files(source)],
    )


def _gguf_config(source: Path) -> dict[str, Any]:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name).to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    for key, value in list(config.items()):
        if isinstance(value, float):
            config[key] = convert._shortest_float32(value)
    return config


def _write_dir(
    dest: Path,
    config: dict[str, Any],
    spec: QuantSpec,
    tensors: dict[str, torch.Tensor],
    overwrite: bool,
    *,
    tokenizer_from: Path,
    sources: list[Path],
) -> Path:
    if dest.exists() and not overwrite:
        raise FileExistsError(f"{dest} already exists; pass overwrite=True to replace it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        tmp.chmod(0o755)
        config = {**config, CONFIG_KEY: spec.record()}
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if tokenizer_from.is_file():  # a GGUF carries its tokenizer
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer_from.parent, gguf_file=tokenizer_from.name).save_pretrained(tmp)
            convert._tidy_tokenizer_config(tmp / "tokenizer_config.json", config["max_position_embeddings"])
        else:
            for name in convert.TOKENIZER_FILES:
                if (tokenizer_from / name).is_file() and not (tmp / name).exists():
                    shutil.copy2(tokenizer_from / name, tmp / name)
        specs: list[convert.TensorSpec] = [(n, tuple(t.shape), t.dtype, convert.held(t)) for n, t in tensors.items()]
        convert._write_safetensors(tmp / convert.WEIGHTS_FILE, specs)
        if not (tmp / "generation_config.json").exists():
            convert._write_generation_config(tmp)
        convert._write_source_record(tmp / convert.SOURCE_RECORD, sources[0], sources, f"quantized {spec.method.value}")
        convert._move_into_place(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest
