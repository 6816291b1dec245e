"""LoRA in the engine on a tiny random-weight model: adapter folders (what is read, what is
refused), the slots' LRU swap, the scheduler's max_loras rule, the prefix cache never sharing
blocks across adapters or with the base, parity with transformers + peft, and speculative
decoding with an adapter."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.lora.adapter import load_adapter, lora_shapes
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.lora.slots import LoRASlots
from pagedserve.engine.model.llama_spec import LlamaSpec
from pagedserve.engine.model.registry import parse_config
from pagedserve.engine.request.request import Request
from pagedserve.engine.sampling.params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
TARGETS = [
    ["q_proj", "v_proj"],
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ["up_proj", "down_proj"],
]


@pytest.fixture(scope="module")
def tiny_adapters(tiny_model_dir, tmp_path_factory):
    """Three peft adapters of the tiny model (ranks 4, 8 rsLoRA, 2; random non-zero B) and each
    one's peft model, for reference outputs."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("tiny-lora")
    torch.manual_seed(3)
    made = []
    for i, (r, rslora, targets) in enumerate([(4, False, TARGETS[0]), (8, True, TARGETS[1]), (2, False, TARGETS[2])]):
        base = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir)
        model = get_peft_model(
            base,
            LoraConfig(r=r, lora_alpha=2 * r + 1, use_rslora=rslora, target_modules=targets, init_lora_weights=False),
        )
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.3)
        model.save_pretrained(root / f"a{i}")
        made.append((LoRARequest(f"a{i}", str(root / f"a{i}")), model.eval()))
    return made


def _spec(tiny_model_dir) -> LlamaSpec:
    return parse_config(json.loads((tiny_model_dir / "config.json").read_text()))


def _run(core: EngineCore, prompts, loras, params=GREEDY, prefix="r") -> list[Request]:
    requests = [Request(f"{prefix}{i}", list(p), params, lora=lora) for i, (p, lora) in enumerate(zip(prompts, loras))]
    for r in requests:
        core.add_request(r)
    while core.has_unfinished_requests():
        core.step()
    return requests


def test_adapter_factors_and_scaling(tiny_model_dir, tiny_adapters):
    shapes = lora_shapes(_spec(tiny_model_dir))
    ref, model = tiny_adapters[1]
    adapter = load_adapter(ref.name, ref.path, shapes, max_rank=16)
    assert adapter.rank == 8 and adapter.scaling == pytest.approx(17 / 8**0.5)  # rsLoRA: alpha / sqrt(r)
    assert len(adapter.factors) == 2 * 7
    a, b = adapter.factors[(1, "k_proj")]
    peft_k = model.base_model.model.model.layers[1].self_attn.k_proj
    assert torch.equal(a, peft_k.lora_A["default"].weight)
    torch.testing.assert_close(b, peft_k.lora_B["default"].weight * peft_k.scaling["default"])
    assert load_adapter("a0", tiny_adapters[0][0].path, shapes, 16).scaling == pytest.approx(9 / 4)
    assert adapter.key.startswith("a1@") and adapter.key != load_adapter("a1", tiny_adapters[0][0].path, shapes, 16).key


@pytest.mark.parametrize(
    "change,message",
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"r": 0}, "r must be"),
        ({"peft_type": "IA3"}, "peft_type"),
    ],
)
def test_refused_configs(tiny_model_dir, tiny_adapters, tmp_path, change, message):
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(tiny_adapters[0][0].path, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(change)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_adapter("bad", folder, lora_shapes(_spec(tiny_model_dir)), 16)


def test_refused_rank_and_folder(tiny_model_dir, tiny_adapters, tmp_path):
    shapes = lora_shapes(_spec(tiny_model_dir))
    with pytest.raises(ValueError, match="rank 8, above max_lora_rank=4"):
        load_adapter("a1", tiny_adapters[1][0].path, shapes, max_rank=4)
    with pytest.raises(ValueError, match="not a PEFT adapter folder"):
        load_adapter("x", tmp_path, shapes, 16)
    small = lora_shapes(_spec(tiny_model_dir).__class__(**{**_as_dict(_spec(tiny_model_dir)), "num_layers": 1}))
    with pytest.raises(ValueError, match="names layer 1, the model has 1"):
        load_adapter("a0", tiny_adapters[0][0].path, small, 16)


def _as_dict(spec: LlamaSpec) -> dict:
    return {name: getattr(spec, name) for name in spec.__dataclass_fields__}


def test_slots_swap_least_recently_used(tiny_model_dir, tiny_adapters):
    shapes = lora_shapes(_spec(tiny_model_dir))
    a0, a1, a2 = (load_adapter(r.name, r.path, shapes, 8) for r, _ in tiny_adapters)
    slots = LoRASlots(shapes, max_loras=2, max_lora_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    assert slots.layers is None  # nothing allocated before the first adapter
    assert slots.activate([a0, a1, a0]) == {a0.key: 0, a1.key: 1}
    assert slots.activate([a1]) == {a1.key: 1}  # a1 is now the most recently used
    assert slots.activate([a2]) == {a2.key: 0}  # evicts a0, the least recently used
    assert slots.activate([a1, a0]) == {a1.key: 1, a0.key: 0}  # a2 goes
    assert slots.num_loads == 4
    with pytest.raises(ValueError, match="3 adapters in one step, but max_loras is 2"):
        slots.activate([a0, a1, a2])
    # a0's slot holds exactly its factors (q at part 0, v at part 2 of qkv), zero elsewhere.
    g = slots.layers[0]["qkv"]
    a, b = a0.factors[(0, "q_proj")]
    assert torch.equal(g.a[0:4], a) and not g.a[4:8].any() and torch.equal(g.a[16:20], a0.factors[(0, "v_proj")][0])
    assert torch.equal(g.b[:32, 0:4], b) and not g.b[32:48, 0:24].any()
    assert not slots.layers[0]["o"].a[:8].any()  # a0 does not target o_proj


def test_greedy_equals_peft_with_mixed_adapters_and_few_slots(tiny_model_dir, tiny_adapters):
    prompts = [list(range(1, 19)), [5, 9, 3, 1], [7, 7, 7], [2, 4, 6, 8, 10]]
    loras = [None] + [ref for ref, _ in tiny_adapters]
    base = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    models = [base] + [model for _, model in tiny_adapters]
    expected = []
    with torch.inference_mode():
        for p, model in zip(prompts * 2, models + models[::-1]):
            expected.append(model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p) :].tolist())
    for max_loras in (4, 1):
        core = EngineCore(EngineConfig(str(tiny_model_dir), num_kv_blocks=64, max_loras=max_loras))
        requests = _run(core, prompts * 2, loras + loras[::-1])
        assert [r.output_token_ids for r in requests] == expected, max_loras
        slots = core.runner.lora.slots  # each adapter loaded once; with one slot, two evictions
        assert slots.num_loads == 3 and len(slots.resident) == min(max_loras, 3)


def test_scheduler_runs_at_most_max_loras_adapters(tiny_model_dir, tiny_adapters):
    core = EngineCore(EngineConfig(str(tiny_model_dir), num_kv_blocks=64, max_loras=2))
    loras = [tiny_adapters[0][0], None, tiny_adapters[1][0], tiny_adapters[2][0], tiny_adapters[0][0]]
    requests = [Request(f"s{i}", [1, 2, 3], GREEDY, lora=lora) for i, lora in enumerate(loras)]
    for r in requests:
        core.add_request(r)
    core.step()
    # a2 (s3) waits: two adapters run; s4 (a0 again) and the plain request run beside them.
    assert [r.request_id for r in core.scheduler.running] == ["s0", "s1", "s2", "s4"]
    while core.has_unfinished_requests():
        assert len({r.lora_id for r in core.scheduler.running if r.lora_id}) <= 2
        core.step()
    assert all(r.num_output_tokens == 8 for r in requests)


def test_prefix_cache_never_shares_blocks_across_adapters(tiny_model_dir, tiny_adapters):
    core = EngineCore(EngineConfig(str(tiny_model_dir), num_kv_blocks=64, block_size=16))
    prompt = list(range(1, 41))  # two full blocks and a partial one
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    a0, a1 = tiny_adapters[0][0], tiny_adapters[1][0]
    renamed = LoRARequest("a0-copy", a0.path)  # the same weights under another name
    order = [None, a0, a1, renamed, a0, None, a1]
    cached = []
    hashes = {}
    for i, lora in enumerate(order):
        (request,) = _run(core, [prompt], [lora], params, prefix=f"p{i}-")
        cached.append(request.num_cached_tokens)
        hashes.setdefault(None if lora is None else lora.name, request.block_hashes[:2])
    assert cached == [0, 0, 0, 0, 32, 32, 32]  # hits only under the same adapter (or the base)
    distinct = [h for hs in hashes.values() for h in hs]
    assert len(set(distinct)) == len(distinct) == 8  # no block hash shared by two adapters or the base
    pool = core.kv_manager.pool
    for h in distinct:  # each of them is its own cached block
        assert pool.get_cached_block(h, prompt[:16] if h in [hs[0] for hs in hashes.values()] else prompt[16:32])


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft"])
def test_speculative_decoding_with_an_adapter_keeps_greedy_tokens(tiny_model_dir, tiny_adapters, method):
    prompt = [3, 5, 7, 3, 5, 7, 3, 5, 7, 3, 5]
    loras = [tiny_adapters[1][0], None, tiny_adapters[0][0]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = EngineCore(EngineConfig(str(tiny_model_dir), num_kv_blocks=64))
    options = {"draft_model": str(tiny_model_dir)} if method == "draft" else {}
    spec = EngineCore(
        EngineConfig(
            str(tiny_model_dir),
            num_kv_blocks=64,
            speculative={"method": method, "num_speculative_tokens": 3, **options},
        )
    )
    expected = [r.output_token_ids for r in _run(plain, [prompt] * 3, loras, params)]
    got = [r.output_token_ids for r in _run(spec, [prompt] * 3, loras, params)]
    assert got == expected
    assert spec.scheduler.num_draft_tokens > 0 and spec.scheduler.num_accepted_tokens > 0


def test_a_bad_adapter_refuses_the_request(tiny_model_dir, tmp_path):
    core = EngineCore(EngineConfig(str(tiny_model_dir), num_kv_blocks=16))
    with pytest.raises(ValueError, match="not a PEFT adapter folder"):
        core.add_request(Request("bad", [1, 2], GREEDY, lora=LoRARequest("x", str(tmp_path))))
    assert not core.has_unfinished_requests()
