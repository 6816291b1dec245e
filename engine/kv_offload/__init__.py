"""Tiered KV offload (engine block pool -> LMCache CPU memory -> local disk).

`config` parses the settings without importing LMCache; `manager` (which imports LMCache) is
loaded only when an engine has `kv_offload` set.
"""

from pagedserve.engine.config.kv_offload import KVOffloadConfig, merge_kv_offload

__all__ = ["KVOffloadConfig", "merge_kv_offload"]
