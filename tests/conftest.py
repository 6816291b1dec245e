"""Shared fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter. The variable is read when a
# kernel is defined, so it is set here, before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model converted to a plain directory in the user cache (converted once)."""
    from engine.model.default_model import default_gguf_path, default_model_dir

    try:
        default_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return default_model_dir()
