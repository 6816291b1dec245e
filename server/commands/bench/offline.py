"""`pagedserve bench offline`: the engine in this process (the offline `LLM`), no HTTP. Each level
is a batch size: the prompts go in batches of that many, each batch run to completion; a
request's latency is its batch's wall time, so the sweep draws the same throughput-latency
trade-off as `bench serve`'s concurrency sweep, without the server."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

from pagedserve.server.commands.bench.stats import distribution


def random_token_prompts(num: int, input_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`num` prompts of exactly `input_len` random token ids (ids 1000.. avoid special tokens)."""
    rng = random.Random(seed)
    low = min(1000, vocab_size // 2)
    return [[rng.randrange(low, vocab_size) for _ in range(input_len)] for _ in range(num)]


def bench_offline(
    model: str,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    batch_sizes: Sequence[int],
    percentiles: Sequence[float],
    seed: int = 0,
    show_progress: bool = True,
    **engine_options,
) -> dict:
    """Run each batch size over the same prompts; the JSON-ready record."""
    from tqdm import tqdm

    from pagedserve.engine import LLM, SamplingParams

    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num-prompts, input-len and output-len must be >= 1")
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise ValueError("batch-sizes: each must be >= 1")
    llm = LLM(model, seed=seed, **engine_options)
    try:
        vocab = len(llm.tokenizer)
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        llm.generate(random_token_prompts(1, input_len, vocab, seed)[0], params)  # warm-up
        levels = []
        for n, batch in enumerate(batch_sizes):
            # New prompts per level: the prefix cache must not carry one level's work to the next.
            prompts = random_token_prompts(num_prompts, input_len, vocab, seed + 1 + n)
            latencies, output_tokens = [], 0
            start = time.perf_counter()
            with tqdm(
                total=num_prompts, desc=f"batch={batch}", disable=not show_progress, unit="req", leave=False
            ) as bar:
                for i in range(0, num_prompts, batch):
                    chunk = prompts[i : i + batch]
                    t0 = time.perf_counter()
                    outs = llm.generate(chunk, params)
                    latencies += [(time.perf_counter() - t0) * 1000] * len(chunk)
                    output_tokens += sum(len(o.outputs[0].token_ids) for o in outs)
                    bar.update(len(chunk))
            duration = time.perf_counter() - start
            levels.append(
                {
                    "level": f"batch={batch}",
                    "batch_size": batch,
                    "completed": num_prompts,
                    "duration_s": duration,
                    "total_input_tokens": num_prompts * input_len,
                    "total_output_tokens": output_tokens,
                    "request_throughput": num_prompts / duration,
                    "output_throughput": output_tokens / duration,
                    "total_token_throughput": (num_prompts * input_len + output_tokens) / duration,
                    "e2el_ms": distribution(latencies, percentiles),
                }
            )
    finally:
        llm.shutdown()
    return {
        "model": model,
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "percentiles": list(percentiles),
        "levels": levels,
    }
