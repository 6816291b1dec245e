"""A separate engine process for the KV offload tests (restart, full disk): generates greedily
for the prompts in a JSON file with offload on a given disk folder, prints one JSON line with
the output tokens and the offload counters, then shuts down (the process must exit by itself).

    python -m tests.engine.kv_offload_child MODEL_DIR PROMPTS_JSON DISK_DIR [--max-file-bytes N]
"""

from __future__ import annotations

import argparse
import json
import resource
import signal

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("prompts")
    parser.add_argument("disk")
    parser.add_argument(
        "--max-file-bytes",
        type=int,
        default=None,
        help="RLIMIT_FSIZE for the generation: writes past it fail (EFBIG), like a full disk",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    from pagedserve.engine import LLM, SamplingParams

    with open(args.prompts) as f:
        prompts = json.load(f)
    llm = LLM(
        args.model,
        dtype="float32",
        num_threads=1,
        num_kv_blocks=40,
        max_model_len=640,
        max_num_batched_tokens=640,
        kv_offload={"cpu_size_gb": 0.1, "disk_path": args.disk, "disk_size_gb": 0.5, "chunk_size": 64},
    )
    if args.max_file_bytes is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (args.max_file_bytes, args.max_file_bytes))
    params = SamplingParams(temperature=0, max_tokens=6)
    tokens = [llm.generate([ids], params)[0].outputs[0].token_ids for ids in prompts]
    flushed = llm.engine.kv_offload.flush()
    stats = llm.engine.kv_offload_stats()
    llm.shutdown()
    print(json.dumps({"tokens": tokens, "stats": stats, "flushed": flushed}))


if __name__ == "__main__":
    main()
