"""`pagedserve serve`: command-line flags -> ServerConfig -> the server."""

from __future__ import annotations

import argparse
import sys

from pagedserve.server.common.config import load_server_config


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run the server (inference, management and metrics ports)",
        description="Serve models over HTTP until SIGINT/SIGTERM. Settings: defaults < --config "
        "file < PAGEDSERVE_* environment < these flags.",
    )
    p.add_argument("--config", metavar="FILE", help="server config YAML (see config/server-config.yaml)")
    p.add_argument("--model-store", metavar="DIR", help="folder of archives (default: model_store)")
    p.add_argument(
        "--models",
        nargs="+",
        metavar="NAME=ARCHIVE",
        help="models to register at start, relative to the model store (or allowed by "
        "allowed_urls): NAME=ARCHIVE, ARCHIVE, a .gguf file, a Hugging Face-style "
        "model folder, 'all', or 'default' (the bundled model, archived into the "
        "store when absent)",
    )
    p.add_argument("--inference-address", metavar="HOST:PORT")
    p.add_argument("--management-address", metavar="HOST:PORT")
    p.add_argument("--metrics-address", metavar="HOST:PORT")
    p.add_argument(
        "--disable-token-auth",
        action="store_true",
        default=None,
        help="no key file, no tokens (token authorization is on by default)",
    )
    p.add_argument(
        "--allow-insecure",
        action="store_true",
        default=None,
        help="allow --disable-token-auth on an address other than loopback",
    )
    p.add_argument(
        "--enable-model-api", action="store_true", default=None, help="allow POST/DELETE /models on the management port"
    )
    p.add_argument(
        "--allow-custom-handlers", action="store_true", default=None, help="accept archives that ship handler code"
    )
    p.add_argument("--key-file", metavar="FILE", help="where to write the keys (key_file.json)")
    p.add_argument(
        "--inference-key",
        metavar="KEY",
        help="use this inference key instead of a generated one (or PAGEDSERVE_INFERENCE_KEY)",
    )
    p.add_argument(
        "--management-key",
        metavar="KEY",
        help="use this management key instead of a generated one (or PAGEDSERVE_MANAGEMENT_KEY)",
    )
    p.add_argument(
        "--keep-key-file",
        action="store_true",
        default=None,
        help="reuse the keys of an existing key file instead of generating new ones",
    )
    p.add_argument(
        "--health-needs-token",
        action="store_true",
        default=None,
        help="the health probes (/ping, /live, /ready, /v2/health/*) need the inference key",
    )
    p.add_argument(
        "--vllm-metrics",
        action="store_true",
        default=None,
        help="also expose vLLM's metric names (vllm:..., label model_name) on the "
        "metrics port, for vLLM's Grafana dashboards",
    )
    p.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="memory all workers may take together, e.g. 12GiB (default: 75%% of RAM)",
    )
    p.add_argument(
        "--ncs",
        "--no-config-snapshots",
        dest="restore_snapshot",
        action="store_false",
        default=None,
        help="do not restore the snapshot of registered models at start",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedserve.server.app.serve import run_serve

    flags = {
        "model_store": args.model_store,
        "load_models": args.models,
        "inference_address": args.inference_address,
        "management_address": args.management_address,
        "metrics_address": args.metrics_address,
        "disable_token_auth": args.disable_token_auth,
        "allow_insecure": args.allow_insecure,
        "enable_model_api": args.enable_model_api,
        "allow_custom_handlers": args.allow_custom_handlers,
        "key_file": args.key_file,
        "restore_snapshot": args.restore_snapshot,
        "inference_key": args.inference_key,
        "management_key": args.management_key,
        "keep_key_file": args.keep_key_file,
        "health_needs_token": args.health_needs_token,
        "vllm_metrics": args.vllm_metrics,
        "memory_budget": args.memory_budget,
    }
    config = load_server_config(args.config, overrides={k: v for k, v in flags.items() if v is not None})
    build_kernels_first()
    try:
        return run_serve(config)
    except OSError as exc:  # e.g. an address already in use
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 1


def build_kernels_first() -> None:
    """Build the CPU kernels here, once, if the install did not (`pagedserve prepare`): a
    worker that had to build them would spend its start-up timeout on it, and several workers
    would wait on one another's build. Silent when they are built (or on a CUDA machine, whose
    workers do not use them). torch is imported only when a build is missing: the front end
    has no other use for it."""
    from pagedserve.server.commands.prepare import build_missing_kernels, cpu_extensions

    if all(ext.is_built() for ext in cpu_extensions()):
        return
    import torch

    if not torch.cuda.is_available():
        build_missing_kernels(
            lambda line: print(line, flush=True),
            why="; `pagedserve prepare`, which .ci/install runs, does it at install time",
        )
