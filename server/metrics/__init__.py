"""The metrics port: pagedserve's families and vLLM's names."""
