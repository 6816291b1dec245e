"""Speculative decoding: an n-gram drafter proposes tokens, one forward pass verifies them."""
