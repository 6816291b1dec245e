"""One parse of a GGUF file per conversion, where transformers would parse it three times.

Converting a GGUF through transformers reads its config, its tokenizer and its weights, and each
of the three builds its own `gguf.GGUFReader`, whose metadata parse walks every element of the
vocabulary's arrays (~5 s for the default model's 49,152 tokens, ~30 s for Gemma 3's 262,144).
Mapping tensor names then calls `gguf.get_tensor_name_map` once per module of the model
(~25 ms each, ~10 s for the default model), though its answer depends only on the architecture
and the layer count.

`gguf_read_once()` makes both answer from a cache for the duration of a `with` block:
transformers looks both names up in the `gguf` package when it calls them, so the block swaps
the package's two attributes and puts them back on exit. A lock serializes the blocks of a
process, so that two conversions in threads never restore each other's swap; a conversion holds
a model's weights in memory, so running them one at a time is what a small machine wants anyway.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_ONE_AT_A_TIME = threading.Lock()


@contextmanager
def gguf_read_once() -> Iterator[None]:
    """Within the block, `gguf.GGUFReader(path)` returns one shared reader per file and mode,
    and `gguf.get_tensor_name_map` one map per (architecture, layer count)."""
    import gguf

    with _ONE_AT_A_TIME:
        original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[tuple[str, str], gguf.GGUFReader] = {}

        def shared_reader(path, mode="r"):
            key = (str(Path(path).resolve()), mode)
            if key not in readers:
                readers[key] = original_reader(path, mode)
            return readers[key]

        setattr(gguf, "GGUFReader", shared_reader)  # noqa: B010 - mypy: a class swapped for a function
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original_map)
        try:
            yield
        finally:
            setattr(gguf, "GGUFReader", original_reader)  # noqa: B010
            gguf.get_tensor_name_map = original_map
            readers.clear()
