"""LoRA adapters at run time: PEFT folders loaded on demand (adapter), kept resident in a few
stacked slots with LRU swap (slots), applied to every token row with its own adapter in one
batched gather-matmul (punica)."""
