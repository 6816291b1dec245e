"""Tests of the compute kernels."""

from __future__ import annotations

import pytest


def built_or_skip(load, name: str):
    """`load()`'s extension, or skip the calling test where it cannot be built here."""
    loaded = load()
    if loaded is None:
        pytest.skip(f"the {name} extension cannot be built here (no g++/ninja?)")
    return loaded
