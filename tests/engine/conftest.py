"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest
import torch
import transformers


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random-weight Llama (vocab 64, 2 layers, GQA 4/2 heads) saved as a model directory."""
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path
