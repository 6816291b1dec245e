"""Shared fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model converted to a plain directory in the user cache (converted once)."""
    from engine.model.default_model import default_gguf_path, default_model_dir

    try:
        default_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return default_model_dir()
