"""The engine-side config schemas (EngineConfig, kv_offload, speculative) and the schema helpers."""
