"""A wrapper of the native extension's DecodeStack that counts its forward calls: how the tests
see that decode steps took the fused path (pagedserve.engine.model.fused_decode)."""

from __future__ import annotations


class CountingStack:
    def __init__(self, stack) -> None:
        self.stack, self.calls = stack, 0

    def forward(self, *args):
        self.calls += 1
        return self.stack.forward(*args)
