"""The `pagedserve` command line."""

from __future__ import annotations

import argparse
import sys
import time

from pagedserve.server.commands.archive import add_archive_parser
from pagedserve.server.commands.bench.cli import add_bench_parser
from pagedserve.server.commands.prepare import add_prepare_parser
from pagedserve.server.commands.serve import add_serve_parser


def _generate(args: argparse.Namespace) -> int:
    from pagedserve.engine import LLM, SamplingParams
    from pagedserve.engine.model.default_model import default_model_dir

    model = args.model or str(default_model_dir())
    llm = LLM(model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    start = time.perf_counter()
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    else:
        outputs = llm.generate(args.prompts, params)
    elapsed = time.perf_counter() - start
    num_tokens = 0
    for prompt, out in zip(args.prompts, outputs):
        completion = out.outputs[0]
        num_tokens += len(completion.token_ids)
        print(
            f"> {prompt}\n{completion.text}\n[{len(completion.token_ids)} tokens, finish: {completion.finish_reason}]\n"
        )
    print(f"{num_tokens} tokens in {elapsed:.2f}s ({num_tokens / elapsed:.1f} tok/s)")
    return 0


class _Parser(argparse.ArgumentParser):
    """The top-level parser: its help ends with the supported architectures, read from the
    model registry only when the help is printed (the registry imports the model families,
    and with them torch: ~2 s that `pagedserve serve`'s front end never needs)."""

    def format_help(self) -> str:
        from pagedserve.engine.model.registry import describe_support

        self.epilog = f"supported model architectures:\n{describe_support()}"
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pagedserve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pagedserve {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline generation with the engine (default model if no --model)")
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    gen.add_argument("--model", help="model directory (default: the bundled SmolLM2-135M-Instruct)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="bfloat16")
    gen.add_argument("--kv-cache-memory", default="512MiB")
    gen.set_defaults(func=_generate)
    add_archive_parser(sub)
    add_serve_parser(sub)
    add_bench_parser(sub)
    add_prepare_parser(sub)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagedserve")
    except PackageNotFoundError:  # run from a checkout that was never pip-installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pagedserve: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
