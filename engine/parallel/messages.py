"""What rank 0 tells the other tensor-parallel ranks, as one flat byte buffer per message.

A message is a msgpack header (its kind, plain fields, and the name, dtype and shape of each
tensor) followed by the tensors' raw bytes: typed, no pickle, and sent with one broadcast of
its bytes (after one of its length, see pagedserve.engine.parallel.group). The step's work travels as the
prepared flattened inputs (token ids, positions and the attention metadata), not as the
SchedulerOutput: the other ranks keep no request state, they run the forward pass on what they
are given against their own KV cache.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import msgspec
import torch

from pagedserve.engine.attention.metadata import AttentionMetadata

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.float16, torch.uint8)
}
_LENGTH_BYTES = 8
_META = "meta."  # tensor names of the attention metadata's fields


class Kind(enum.IntEnum):
    FORWARD = 1  # run the model on input_ids, positions, meta
    LOGITS = 2  # compute this rank's logits of `hidden` for the gather to rank 0
    THREADS = 3  # torch threads from now on: fields["threads"]
    STOP = 4  # leave the loop and exit


class _TensorSpec(msgspec.Struct, array_like=True):
    name: str
    dtype: str
    shape: list[int]


class _Header(msgspec.Struct, array_like=True):
    kind: Kind
    fields: dict[str, Any]
    tensors: list[_TensorSpec]


@dataclasses.dataclass(slots=True)
class Message:
    kind: Kind
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def encode(message: Message) -> torch.Tensor:
    """The message as one uint8 CPU tensor: header length, header, then each tensor's bytes."""
    flat = {name: t.detach().to("cpu").contiguous().reshape(-1) for name, t in message.tensors.items()}
    specs = [
        _TensorSpec(name, str(t.dtype).removeprefix("torch."), list(message.tensors[name].shape))
        for name, t in flat.items()
    ]
    header = msgspec.msgpack.encode(_Header(message.kind, message.fields, specs))
    parts = [
        torch.tensor([len(header)], dtype=torch.int64).view(torch.uint8),
        torch.frombuffer(bytearray(header), dtype=torch.uint8),
    ]
    parts += [t.view(torch.uint8) for t in flat.values()]
    return torch.cat(parts)


def decode(buffer: torch.Tensor, device: torch.device) -> Message:
    """Read back what `encode` wrote; the tensors land on `device`."""
    length = int(buffer[:_LENGTH_BYTES].view(torch.int64).item())
    end = _LENGTH_BYTES + length
    header = msgspec.msgpack.decode(buffer[_LENGTH_BYTES:end].numpy().tobytes(), type=_Header)
    tensors = {}
    for spec in header.tensors:
        dtype = _DTYPES[spec.dtype]
        size = dtype.itemsize * _numel(spec.shape)
        raw = buffer[end : end + size].clone()  # its own storage, aligned for the view below
        tensors[spec.name] = raw.view(dtype).reshape(spec.shape).to(device)
        end += size
    return Message(header.kind, header.fields, tensors)


def _numel(shape: list[int]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def forward_message(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> Message:
    """The step's flattened inputs: every tensor field of the metadata as a tensor, the rest
    (counts and host-side lists) as plain fields."""
    tensors = {"input_ids": input_ids, "positions": positions}
    fields = {}
    for field in dataclasses.fields(meta):
        if not field.init:
            continue  # derived again when the other rank builds its metadata
        value = getattr(meta, field.name)
        if isinstance(value, torch.Tensor):
            tensors[_META + field.name] = value
        else:
            fields[field.name] = value
    return Message(Kind.FORWARD, fields, tensors)


def read_forward(message: Message) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, metadata) of a FORWARD message."""
    tensors = {name.removeprefix(_META): t for name, t in message.tensors.items() if name.startswith(_META)}
    fields: dict[str, Any] = {**message.fields, **tensors}  # write_forward's split, joined back
    meta = AttentionMetadata(**fields)
    return message.tensors["input_ids"], message.tensors["positions"], meta
