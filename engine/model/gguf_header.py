"""A GGUF file's header read without its data: the scalar metadata and the tensor table.

`gguf.GGUFReader` builds a numpy view for every element of every metadata array, so a
tokenizer's vocabulary (262,144 tokens and their merges in Gemma 3) costs it tens of seconds;
registering a model from a path needs only the architecture and the tensors' types. Here the
arrays are stepped over and the tensor infos read with `struct` from a memory map.
Little-endian GGUF, versions 2 and 3 (what llama.cpp writes); anything else is a ValueError.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import msgspec

# GGUF value types: struct format of the fixed-size ones; 8 = string, 9 = array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFTensor(msgspec.Struct, frozen=True):
    name: str
    type_name: str  # gguf.GGMLQuantizationType's name: F32, Q4_K, ...
    n_elements: int


class GGUFHeader(msgspec.Struct, frozen=True):
    fields: dict[str, Any]  # scalar and string metadata; arrays are left out
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        self.skip(n)
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def skip(self, n: int) -> None:
        self.pos += n
        if self.pos > len(self.buf):  # a corrupt length: stop at once, not after 2**64 steps
            raise struct.error("a length runs past the end of the file")

    def skip_string(self) -> None:
        self.skip(8 + struct.unpack_from("<Q", self.buf, self.pos)[0])

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _SCALARS:
                self.skip(count * struct.calcsize(_SCALARS[item]))
            else:
                for _ in range(count):
                    self.skip_string() if item == _STRING else self.value(item)
            return None
        raise ValueError(f"unknown GGUF value type {kind}")


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """The metadata (arrays left out) and tensor table of the GGUF file at `path`; ValueError
    for a file that is not a little-endian GGUF of version 2 or 3, or is cut short."""
    from gguf import GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf)
        try:
            if bytes(buf[:4]) != b"GGUF":
                raise ValueError("no GGUF magic")
            cur.pos = 4
            version = cur.unpack("<I")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (big-endian or unsupported)")
            n_tensors, n_fields = cur.unpack("<Q"), cur.unpack("<Q")
            fields: dict[str, Any] = {}
            for _ in range(n_fields):
                key, kind = cur.string(), cur.unpack("<I")
                value = cur.value(kind)
                if kind != _ARRAY:
                    fields[key] = value
            tensors = []
            for _ in range(n_tensors):
                name, n_dims = cur.string(), cur.unpack("<I")
                n_elements = 1
                for _ in range(n_dims):
                    n_elements *= cur.unpack("<Q")
                kind = cur.unpack("<I")
                cur.pos += 8  # the data offset
                tensors.append(GGUFTensor(name, GGMLQuantizationType(kind).name, n_elements))
        except struct.error as exc:
            raise ValueError(f"cut short ({exc})") from None
    return GGUFHeader(fields, tensors)
