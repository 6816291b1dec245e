"""`pagedserve bench serve|offline`: flags -> a sweep -> a JSON record, a PNG of the
throughput-latency curve and a table on stdout."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

from pagedserve.server.commands.bench.harness import peak_rss_mib, provenance, stamp
from pagedserve.server.commands.bench.stats import parse_percentiles, parse_slos


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmark a running server (serve) or the engine in this process (offline)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    serve = kinds.add_parser(
        "serve",
        help="load a running server over HTTP (streamed /v1/completions)",
        description="Sweep a concurrency cap or a request rate against a running server; report "
        "TTFT, TPOT, ITL and end-to-end latency percentiles, throughput and goodput.",
    )
    serve.add_argument("--url", default="http://127.0.0.1:8080", help="the inference port's base URL")
    serve.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    serve.add_argument(
        "--api-key", help="inference key (default: PAGEDSERVE_INFERENCE_KEY, or the inference key in --key-file)"
    )
    serve.add_argument(
        "--key-file",
        default="key_file.json",
        help="the server's key file, read when it exists (default: key_file.json)",
    )
    serve.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        metavar="N",
        help="sweep: at most N requests in flight, all queued at once (default: 1)",
    )
    serve.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        metavar="R",
        help="sweep: Poisson arrivals at R requests/s ('inf': all at once)",
    )
    serve.add_argument("--max-concurrency", type=int, help="cap in flight with --request-rate")
    serve.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1: Poisson; lower: burstier)"
    )
    serve.add_argument("--num-prompts", type=int, default=16, help="requests per level")
    serve.add_argument("--dataset", choices=("random", "file"), default="random")
    serve.add_argument("--dataset-path", help="prompts file (.jsonl, .json or text lines)")
    serve.add_argument(
        "--random-input-len", type=int, default=128, help="words per random prompt (about one token each)"
    )
    serve.add_argument(
        "--random-output-len", type=int, default=64, help="max_tokens of each request (file prompts may set their own)"
    )
    serve.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="draw random lengths from [len*(1-r), len*(1+r)]"
    )
    serve.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS (default: exactly max_tokens each)",
    )
    serve.add_argument(
        "--goodput",
        nargs="+",
        metavar="KEY:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000 (milliseconds)",
    )
    serve.add_argument("--warmup", type=int, default=1, help="uncounted requests sent first")
    serve.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    _common(serve)
    serve.set_defaults(func=_serve)

    offline = kinds.add_parser(
        "offline",
        help="the engine in this process, no server",
        description="Random token prompts in batches of each --batch-sizes value through the "
        "offline LLM; throughput and per-request latency per batch size.",
    )
    offline.add_argument("--model", help="model directory or archive (default: the bundled model)")
    offline.add_argument("--num-prompts", type=int, default=16)
    offline.add_argument("--input-len", type=int, default=128, help="tokens per prompt")
    offline.add_argument("--output-len", type=int, default=64, help="tokens generated per prompt")
    offline.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16], metavar="B")
    offline.add_argument("--dtype", default="bfloat16")
    offline.add_argument("--kv-cache-memory", default="512MiB")
    offline.add_argument("--num-threads", type=int, help="torch threads (default: torch's)")
    _common(offline)
    offline.set_defaults(func=_offline)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--percentiles", default="50,90,99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-dir", default=".", help="where the JSON and PNG go")
    p.add_argument("--result-json", help="JSON path (default: RESULT_DIR/bench-KIND-TIME.json)")
    p.add_argument("--plot", help="PNG path (default: the JSON path with .png)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key:
        return args.api_key
    if os.environ.get("PAGEDSERVE_INFERENCE_KEY"):
        return os.environ["PAGEDSERVE_INFERENCE_KEY"]
    path = Path(args.key_file)
    if path.is_file():
        try:
            return json.loads(path.read_text())["inference"]["key"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}: not a key file with an inference key") from None
    return None


def _serve(args: argparse.Namespace) -> int:
    from pagedserve.server.commands.bench.serve_bench import ServeTarget, bench_serve, sweep
    from pagedserve.server.commands.bench.workload import file_requests, random_requests

    percentiles = parse_percentiles(args.percentiles)
    slos = parse_slos(args.goodput)
    levels = sweep(args.concurrency, args.request_rate, args.max_concurrency)
    if args.dataset == "file":
        if not args.dataset_path:
            raise ValueError("--dataset file needs --dataset-path")
        workloads = [file_requests(args.dataset_path, args.num_prompts, args.random_output_len)] * len(levels)
        warmup = workloads[0][: args.warmup]
    else:
        # Fresh prompts per level: the prefix cache must not carry one level's work to the next.
        workloads = [
            random_requests(
                args.num_prompts,
                args.random_input_len,
                args.random_output_len,
                args.random_range_ratio,
                seed=args.seed + 1 + i,
            )
            for i in range(len(levels))
        ]
        warmup = (
            random_requests(args.warmup, args.random_input_len, args.random_output_len, seed=args.seed)
            if args.warmup > 0
            else []
        )
    target = ServeTarget(args.url.rstrip("/"), args.model, _api_key(args), args.timeout)
    record = asyncio.run(
        bench_serve(
            target,
            workloads,
            levels,
            percentiles=percentiles,
            slos=slos,
            warmup=warmup,
            burstiness=args.burstiness,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            show_progress=not args.disable_tqdm,
        )
    )
    return _finish(args, "serve", record, f"pagedserve bench serve: {record['model']}")


def _offline(args: argparse.Namespace) -> int:
    from pagedserve.server.commands.bench.offline import bench_offline

    model = args.model
    if model is None:
        from pagedserve.engine.model.default_model import default_model_dir

        model = str(default_model_dir())
    options = {"dtype": args.dtype, "kv_cache_memory": args.kv_cache_memory}
    if args.num_threads:
        options["num_threads"] = args.num_threads
    record = bench_offline(
        model,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        batch_sizes=args.batch_sizes,
        percentiles=parse_percentiles(args.percentiles),
        seed=args.seed,
        show_progress=not args.disable_tqdm,
        **options,
    )
    return _finish(
        args,
        "offline",
        record,
        f"pagedserve bench offline: {Path(model).name}",
        panels=(("e2el_ms", "request latency (ms)"),),
    )


def _finish(args: argparse.Namespace, kind: str, record: dict, title: str, **plot_kw) -> int:
    from pagedserve.server.commands.bench.plot import plot_curve

    # Named like every benchmark's result (the shared harness): the commit, the CPU, the load;
    # the peak memory of this process (offline: the engine's too).
    record = {
        "kind": kind,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **provenance(),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        **record,
    }
    json_path = (
        Path(args.result_json)
        if args.result_json
        else (Path(args.result_dir) / f"bench-{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    )
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(record, indent=2) + "\n")
    print(_table(record))
    print(stamp(record))
    print(f"results: {json_path}")
    if not args.no_plot:
        png = plot_curve(record["levels"], args.plot or json_path.with_suffix(".png"), title, **plot_kw)
        print(f"plot: {png}")
    failed = sum(lv.get("failed", 0) for lv in record["levels"])
    return 1 if failed else 0


def _table(record: dict) -> str:
    top = f"p{record['percentiles'][-1]:g}"
    rows = [
        f"{'level':>16} {'req/s':>8} {'out tok/s':>10} {'TTFT med':>9} {'TTFT ' + top:>10} "
        f"{'TPOT med':>9} {'e2e med':>9} {'e2e ' + top:>10} {'goodput':>8} {'failed':>6}"
    ]
    for lv in record["levels"]:
        ttft, tpot = lv.get("ttft_ms"), lv.get("tpot_ms")
        rows.append(
            f"{lv['level']:>16} {lv['request_throughput']:8.2f} {lv['output_throughput']:10.1f} "
            f"{_ms(ttft, 'median'):>9} {_ms(ttft, top):>10} {_ms(tpot, 'median'):>9} "
            f"{_ms(lv['e2el_ms'], 'median'):>9} {_ms(lv['e2el_ms'], top):>10} "
            f"{_goodput(lv):>8} {lv.get('failed', 0):>6}"
        )
    return "\n".join(rows) + "\n(latencies in ms)"


def _goodput(level: dict) -> str:
    return f"{level['goodput']:.2f}" if "goodput" in level else "-"


def _ms(dist: dict | None, key: str) -> str:
    return "-" if dist is None else f"{dist[key]:.1f}"
