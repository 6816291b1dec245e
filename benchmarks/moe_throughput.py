"""Mixture-of-experts decode throughput: this engine vs Hugging Face transformers, side by side.

Model: a random-weight MoE of about 1B parameters with 8 experts (top-2), written once as bf16
safetensors under `--workdir` by transformers itself (default architecture Qwen3-MoE; `--arch
mixtral` for Mixtral's layout): hidden 1024, 12 layers, 16 query / 4 KV heads, expert
intermediate size 2816, the default model's tokenizer (vocabulary 49152).

Measurement: decode tokens/s at batch 1 and batch 32 (16-token prompts of random ids; the rate
is `B * (N - 1) / (time(N tokens) - time(1 token))`, so prefill is excluded), bfloat16, one
thread per side (`--threads`): on a shared, busy 2-core machine two OpenMP threads stall each
other whenever one is descheduled, which punishes whichever side runs more small ops.
Each side runs in a fresh child process per round; a round runs the engine and transformers
once each, the order reversed every other round, the ratios are taken within a round (paired)
and printed, and the result is the median over the rounds (>= 5), never the best round.

The engine child then runs batch-1 and batch-32 generation once more (SHARE_TOKENS tokens) with
CPU-time timers on every routed expert's projections (gate_up_proj, down_proj) and on each MoE
block: the share of decode CPU time spent in expert GEMMs, and in the whole MoE block (router,
grouping, gather, scatter included).

    .venv/bin/python benchmarks/moe_throughput.py [--rounds 5] [--arch qwen3_moe]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

from _common import RESULTS, peak_rss_mib, result_path, run_phase

from pagedserve.server.commands.bench.harness import MIN_ROUNDS, PairedRounds, alternating_rounds, provenance, stamp

SHARE_TOKENS = 4  # tokens per sequence of the engine's timed share run
BATCHES = (1, 32)
PROMPT_LEN = 16
SIZES = {
    "hidden_size": 1024,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
ARCHS = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 2816,
            "intermediate_size": 2816,
            "norm_topk_prob": True,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 2816},
    ),
}


def build_model(args) -> Path:
    """The random model's folder (built once, reused by every child and later runs)."""
    path = Path(args.workdir) / args.arch
    if (path / "config.json").is_file():
        return path
    import torch
    import transformers

    from pagedserve.engine.model.default_model import default_model_dir

    config_cls, model_cls, moe = ARCHS[args.arch]
    config = getattr(transformers, config_cls)(**SIZES, **moe)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    source = default_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp / name)
    tmp.rename(path)
    return path


def count_params(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= d
                total += n
    return total


def prompts(batch: int) -> list[list[int]]:
    import random

    rng = random.Random(batch)
    return [[rng.randrange(1000, 40000) for _ in range(PROMPT_LEN)] for _ in range(batch)]


def decode_rates(generate, tokens: int) -> dict[str, float]:
    """`generate(prompts, n)` -> decode tokens/s per batch size, prefill excluded."""
    out = {}
    for batch in BATCHES:
        ps = prompts(batch)
        generate(ps, 2)  # warm-up
        start = time.perf_counter()
        generate(ps, 1)
        one = time.perf_counter() - start
        start = time.perf_counter()
        generate(ps, tokens)
        full = time.perf_counter() - start
        out[f"batch{batch}_tok_per_s"] = batch * (tokens - 1) / (full - one)
    return out


class ShareTimer:
    """CPU time of the process (one torch thread runs every op) inside the routed
    experts' projections and inside the MoE blocks (forward hooks). CPU time, not wall time: on a
    busy machine a wall clock charges whichever op was running when the process was descheduled."""

    def __init__(self, model) -> None:
        from pagedserve.engine.model.layers.moe import SparseMoeBlock

        self.totals = {"expert_gemm_s": 0.0, "moe_block_s": 0.0}
        self.handles = []
        for module in model.modules():
            if isinstance(module, SparseMoeBlock):
                self._time(module, "moe_block_s")
                for expert in module.experts:
                    self._time(expert.gate_up_proj, "expert_gemm_s")
                    self._time(expert.down_proj, "expert_gemm_s")

    def _time(self, module, key: str) -> None:
        starts: list[float] = []

        def pre(mod, args):
            starts.append(time.process_time())

        def post(mod, args, out):
            self.totals[key] += time.process_time() - starts.pop()

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def phase_engine(args) -> dict:
    from pagedserve.engine import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype="bfloat16",
        num_threads=args.threads,
        kv_cache_memory="256MiB",
        max_num_seqs=max(BATCHES),
        max_num_batched_tokens=1024,
    )

    def generate(ps, n):
        llm.generate(ps, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0))

    result = decode_rates(generate, args.tokens)
    timer = ShareTimer(llm.engine.runner.model)
    for batch in BATCHES:
        for key in timer.totals:
            timer.totals[key] = 0.0
        start = time.process_time()
        generate(prompts(batch), SHARE_TOKENS)
        cpu = time.process_time() - start
        result[f"batch{batch}_expert_gemm_share"] = timer.totals["expert_gemm_s"] / cpu
        result[f"batch{batch}_moe_block_share"] = timer.totals["moe_block_s"] / cpu
    timer.remove()
    return result | {"peak_rss_mib": peak_rss_mib()}


def phase_hf(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).eval()

    def generate(ps, n):
        with torch.inference_mode():
            ids = torch.tensor(ps)
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )

    return decode_rates(generate, args.tokens) | {
        "experts_implementation": str(getattr(model.config, "_experts_implementation", "eager")),
        "peak_rss_mib": peak_rss_mib(),
    }


def run_child(args, phase: str) -> dict:
    result = run_phase(
        __file__,
        ["--phase", phase, "--model", str(args.model), "--tokens", str(args.tokens), "--threads", str(args.threads)],
    )
    print(
        f"  {phase}: {json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()})}",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", choices=("engine", "hf"))
    parser.add_argument("--model")
    parser.add_argument("--arch", choices=tuple(ARCHS), default="qwen3_moe")
    parser.add_argument("--workdir", default="/tmp/pagedserve-moe-bench")
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    parser.add_argument("--tokens", type=int, default=8, help="tokens generated per sequence")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per side")
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(phase_engine(args) if args.phase == "engine" else phase_hf(args)))
        return
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}")
    args.model = build_model(args)
    params = count_params(args.model)
    print(f"model {args.model}: {params / 1e9:.3f}B parameters", flush=True)

    def ratios(r: int, order: tuple[str, ...], runs: dict[str, list[dict]]) -> None:
        e, h = runs["engine"][-1], runs["hf"][-1]
        print(
            f"round {r + 1}/{args.rounds} ({', '.join(order)}) ratios: "
            + ", ".join(f"batch {b} {e[f'batch{b}_tok_per_s'] / h[f'batch{b}_tok_per_s']:.2f}x" for b in BATCHES),
            flush=True,
        )

    # the shared harness: each side once per round, the order reversed every other round
    runs = alternating_rounds(("engine", "hf"), lambda phase: run_child(args, phase), args.rounds, on_round=ratios)
    summary = summarize(args, runs, params)
    RESULTS.mkdir(exist_ok=True)
    result_path("moe_throughput", "json").write_text(json.dumps(summary | {"runs": runs}, indent=2))
    result_path("moe_throughput", "md").write_text(markdown(summary))
    print(markdown(summary))


def summarize(args, runs, params: int) -> dict:
    out = {
        "arch": args.arch,
        "total_params": params,
        "experts": 8,
        "top_k": 2,
        "dtype": "bfloat16",
        "threads": args.threads,
        "prompt_len": PROMPT_LEN,
        "tokens": args.tokens,
        "rounds": args.rounds,
        **provenance(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "hf_experts_implementation": runs["hf"][0]["experts_implementation"],
    }
    for b in BATCHES:
        paired = PairedRounds("hf", "engine", f"batch{b}_tok_per_s", runs=runs)  # engine / hf per round
        out[f"batch{b}"] = {
            "engine_tok_per_s": paired.side_median("engine"),
            "hf_tok_per_s": paired.side_median("hf"),
            "ratios": paired.ratios,
            "median_ratio": paired.ratio_median,
            "expert_gemm_share": replace(paired, metric=f"batch{b}_expert_gemm_share").side_median("engine"),
            "moe_block_share": replace(paired, metric=f"batch{b}_moe_block_share").side_median("engine"),
        }
    return out


def markdown(s: dict) -> str:
    rows = "\n".join(
        f"| {b} | {s[f'batch{b}']['engine_tok_per_s']:.1f} | {s[f'batch{b}']['hf_tok_per_s']:.1f} | "
        f"**{s[f'batch{b}']['median_ratio']:.2f}x** ({', '.join(f'{r:.2f}' for r in s[f'batch{b}']['ratios'])}) | "
        f"{100 * s[f'batch{b}']['expert_gemm_share']:.0f} % | {100 * s[f'batch{b}']['moe_block_share']:.0f} % |"
        for b in BATCHES
    )
    return f"""# MoE decode throughput: pagedserve vs transformers

Random-weight {s['arch']} of {s['total_params'] / 1e9:.2f}B parameters, {s['experts']} experts
(top-{s['top_k']}), {s['dtype']}, {s['threads']} torch thread(s) per side, {s['prompt_len']}-token prompts,
{s['tokens']} tokens generated per sequence; decode tokens/s with prefill excluded. Median of
{s['rounds']} paired rounds (engine and transformers in fresh processes, order alternating);
per-round ratios in brackets. Each side's tok/s is its own median over the rounds, the ratio
the median of the per-round (paired) ratios, so the two need not agree: on this machine the
load moved from round to round, and the spread of the per-round ratios is the honest error bar.
transformers' experts implementation: `{s['hf_experts_implementation']}`.

{stamp(s)} Run on {s['date']}.

| batch | pagedserve tok/s | transformers tok/s | pagedserve / transformers | expert GEMMs (share of decode CPU) \
| whole MoE block |
| --- | --- | --- | --- | --- | --- |
{rows}

Expert GEMMs: the process's CPU time (one torch thread) inside the routed experts' `gate_up_proj`
and `down_proj` calls over the CPU time of a separate {SHARE_TOKENS}-token generation by the engine
child (its prompts already in the prefix cache, so nearly all decode steps). Whole MoE block: the
same for the sparse blocks (router, grouping by expert, gather, expert MLPs, weighted scatter-add).

    .venv/bin/python benchmarks/moe_throughput.py --rounds {s['rounds']} --arch {s['arch']} --tokens {s['tokens']}
"""


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
