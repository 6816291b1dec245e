"""LoRA greedy parity with transformers + peft on the real default model, float32.

Three adapters are made here with `peft` (different ranks, targets, alphas, one rsLoRA), with
random non-zero B matrices, so each changes the model's output. Our engine's greedy tokens for
every (prompt, adapter) pair, and for plain requests, must equal `generate` of transformers +
peft — with the three adapters and plain requests in one batch (max_loras=4: one step holds
them all), and with max_loras=2 (adapters swapped in and out of the slots). One float32 engine
per configuration, 8 tokens each.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.slow

MAX_NEW = 8
# (name, rank, alpha, rsLoRA, targets)
ADAPTERS = [
    ("all-r8", 8, 16, False, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("qv-r4-rs", 4, 6, True, ["q_proj", "v_proj"]),
    ("mlp-r16", 16, 32, False, ["gate_proj", "up_proj", "down_proj", "o_proj"]),
]
PROMPTS = ["1, 2, 3, 4,", "The capital of France is", "Once upon a time, there was a"]


@pytest.fixture(scope="module")
def adapters(default_model_dir, tmp_path_factory):
    """The three adapters' folders, and transformers + peft greedy outputs for every prompt
    (key None: the base model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("lora-adapters")
    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    base = AutoModelForCausalLM.from_pretrained(str(default_model_dir), torch_dtype=torch.float32)
    base.eval()
    prompts = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    torch.manual_seed(1234)
    model = None
    folders = {}
    for name, r, alpha, rslora, targets in ADAPTERS:
        config = LoraConfig(
            r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets, init_lora_weights=False, lora_dropout=0.0
        )
        if model is None:
            model = get_peft_model(base, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if f".{name}." in pname and "lora_" in pname:
                    p.normal_(0.0, 0.04 if "lora_A" in pname else 0.03)
        model.save_pretrained(str(root), selected_adapters=[name])
        folders[name] = root / name if (root / name).is_dir() else root
    model.eval()

    def greedy(ids: list[int]) -> list[int]:
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
        return out[0, len(ids) :].tolist()

    expected = {}
    with torch.inference_mode():
        with model.disable_adapter():
            expected[None] = [greedy(p) for p in prompts]
        for name, *_ in ADAPTERS:
            model.set_adapter(name)
            expected[name] = [greedy(p) for p in prompts]
    for name, *_ in ADAPTERS:  # every adapter changes the output of at least one prompt
        assert expected[name] != expected[None], name
    return prompts, {name: LoRARequest(name, str(folder)) for name, folder in folders.items()}, expected


def _mixed_batch(adapters):
    prompts, refs, expected = adapters
    names = [None] + [name for name, *_ in ADAPTERS]
    batch = [(p, name) for name in names for p in range(len(prompts))]
    batch = batch[::2] + batch[1::2]  # adapters interleaved with plain requests
    return (
        [prompts[p] for p, _ in batch],
        [None if n is None else refs[n] for _, n in batch],
        [expected[n][p] for p, n in batch],
    )


def _generate(llm: LLM, adapters):
    prompts, loras, expected = _mixed_batch(adapters)
    out = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True), lora=loras)
    return [o.outputs[0].token_ids for o in out], expected


def test_three_adapters_and_plain_requests_in_one_batch(default_model_dir, adapters):
    llm = LLM(default_model_dir, dtype="float32", kv_cache_memory="64MiB", max_model_len=256, max_loras=4)
    try:
        steps = []
        build = llm.engine.runner.lora.build_batch

        def spy(adapters_, num_rows, use_triton=None):
            steps.append({None if a is None else a.name for a in adapters_})
            return build(adapters_, num_rows, use_triton)

        llm.engine.runner.lora.build_batch = spy
        got, expected = _generate(llm, adapters)
        assert got == expected
        assert {None, *(name for name, *_ in ADAPTERS)} in steps  # one step ran all of them together
    finally:
        llm.shutdown()


def test_forced_swaps_with_two_slots(default_model_dir, adapters):
    llm = LLM(default_model_dir, dtype="float32", kv_cache_memory="64MiB", max_model_len=256, max_loras=2)
    try:
        got, expected = _generate(llm, adapters)
        assert got == expected
        slots = llm.engine.runner.lora.slots  # three adapters through two slots: one was swapped out
        assert slots.num_loads >= 3 and len(slots.resident) == 2
    finally:
        llm.shutdown()
