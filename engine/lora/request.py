"""How a request names its LoRA adapter: a name and the PEFT folder it loads from.

A msgspec Struct, so it crosses the socket to a worker as it is (pagedserve.engine.core.messages). The
folder is read by the engine the first time a request names the adapter; a worker restarted
later loads it again from the same place, with nothing to re-register.
"""

from __future__ import annotations

from typing import Annotated

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`name`: the adapter's name (what a client asks for); `path`: its PEFT folder
    (`adapter_config.json` + `adapter_model.safetensors`)."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    path: Annotated[str, msgspec.Meta(min_length=1)]
