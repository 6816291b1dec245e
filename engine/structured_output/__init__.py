"""Structured output: the constraint (params and limits) and the grammar manager (xgrammar)."""
