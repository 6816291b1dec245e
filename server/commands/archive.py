"""`pagedserve archive`: package a model into an archive, or verify one with `--inspect`."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pagedserve.engine.model.archive_manifest import BUILTIN_HANDLER, ArchiveFormat

DEFAULT_EXPORT_PATH = "model_store"


def add_archive_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "archive",
        help="package a model as an archive (.mar, .tar.gz or folder), or --inspect one",
        description="Package a model directory, a GGUF file or the bundled default model into a "
        "TorchServe-style model archive; or verify an archive with --inspect.",
    )
    p.add_argument(
        "--inspect", metavar="FILE", help="verify FILE as the server would and print its manifest and model config"
    )
    p.add_argument(
        "--allow-custom-handlers",
        action="store_true",
        help="with --inspect: accept a handler .py shipped in the archive",
    )
    p.add_argument("--model-name", help="archive name (the file is NAME.mar, NAME.tar.gz or NAME/)")
    p.add_argument("--version", help="model version recorded in the manifest")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model-dir", help="a model directory (config.json, safetensors, tokenizer)")
    source.add_argument(
        "--gguf",
        help="a .gguf file, converted to safetensors keeping its quantization "
        "(Q4_0/Q4_1/Q4_K -> int4, others int8) unless --quantize says otherwise",
    )
    source.add_argument("--default-model", action="store_true", help="the bundled SmolLM2-135M-Instruct (no download)")
    source.add_argument(
        "--lora-dir",
        help="a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors); needs --base-model",
    )
    p.add_argument(
        "--base-model",
        metavar="NAME[:VERSION]",
        help="with --lora-dir: the base model the adapter runs on; its archive is looked "
        "up in --export-path and its weights' hash recorded in the manifest",
    )
    p.add_argument(
        "--quantize",
        choices=["none", "int8", "int4", "w8a8"],
        help="quantize the weights at archive time (default: none, or a GGUF's own "
        "quantization; 'none' with --gguf de-quantizes it to float32)",
    )
    p.add_argument(
        "--quant-group-size", type=int, default=32, choices=[32, 64, 128], help="int4 group size (default 32)"
    )
    p.add_argument(
        "--handler", default=BUILTIN_HANDLER, help=f"{BUILTIN_HANDLER!r} (built in, the default) or a handler .py file"
    )
    p.add_argument("--config-file", help="model-config.yaml (see config/model-config.yaml)")
    p.add_argument("--extra-files", default="", help="comma-separated files or folders to include")
    p.add_argument("--archive-format", default=ArchiveFormat.DEFAULT.value, choices=[f.value for f in ArchiveFormat])
    p.add_argument(
        "--export-path",
        default=DEFAULT_EXPORT_PATH,
        help=f"folder to write the archive to (default: {DEFAULT_EXPORT_PATH}/)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing archive")
    p.set_defaults(func=run_archive)


def run_archive(args: argparse.Namespace) -> int:
    if args.inspect:
        return _inspect(Path(args.inspect), args.allow_custom_handlers)
    missing = [flag for flag, value in (("--model-name", args.model_name), ("--version", args.version)) if not value]
    if not (args.model_dir or args.gguf or args.default_model or args.lora_dir):
        missing.append("one of --model-dir, --gguf, --default-model, --lora-dir")
    if args.lora_dir and not args.base_model:
        missing.append("--base-model (with --lora-dir)")
    if missing:
        raise ValueError(f"archive needs {', '.join(missing)} (or --inspect FILE)")
    if args.base_model and not args.lora_dir:
        raise ValueError("--base-model goes with --lora-dir")
    if args.lora_dir:
        from pagedserve.engine.model.lora_archive import write_lora_archive

        base, _, base_version = args.base_model.partition(":")
        print(
            write_lora_archive(
                args.lora_dir,
                args.export_path,
                model_name=args.model_name,
                version=args.version,
                base_model=base,
                base_version=base_version or None,
                model_store=args.export_path,
                archive_format=args.archive_format,
                force=args.force,
            )
        )
        return 0
    if args.config_file:
        from pagedserve.engine.model.model_config import load_model_config

        load_model_config(args.config_file)  # refuse now what open_archive would refuse later
    with _model_source(args) as model_dir, _progress_bar() as progress:
        from pagedserve.engine.model.archive_write import write_archive

        dest = write_archive(
            model_dir,
            args.export_path,
            model_name=args.model_name,
            version=args.version,
            handler=args.handler,
            config_file=args.config_file,
            extra_files=[f for f in args.extra_files.split(",") if f.strip()],
            archive_format=args.archive_format,
            force=args.force,
            progress=progress,
        )
    print(dest)
    return 0


@contextmanager
def _model_source(args: argparse.Namespace) -> Iterator[Path]:
    """The model directory to archive; a GGUF, or a model to quantize, is converted into a
    temporary one first."""
    with tempfile.TemporaryDirectory(prefix="pagedserve-convert-") as tmp:
        if args.gguf and args.quantize is None:
            from pagedserve.engine.model.quant_convert import convert_gguf_quantized

            yield convert_gguf_quantized(args.gguf, Path(tmp) / "model")
            return
        if args.model_dir:
            plain = Path(args.model_dir)
        elif args.default_model:
            from pagedserve.engine.model.default_model import default_model_dir

            plain = default_model_dir()
        else:
            from pagedserve.engine.model.convert import convert_model

            plain = convert_model(args.gguf, Path(tmp) / "plain")
        if args.quantize in (None, "none"):
            yield plain
        else:
            from pagedserve.engine.model.quant_convert import quantize_model_dir

            yield quantize_model_dir(plain, Path(tmp) / "model", args.quantize, args.quant_group_size)


@contextmanager
def _progress_bar() -> Iterator[Callable[[int, int], None] | None]:
    """A tqdm byte counter on a terminal; nothing when stderr is a pipe or a file."""
    if not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    bars: list[tqdm] = []  # created on the first report, once the total is known

    def update(done: int, total: int) -> None:
        if not bars:
            bars.append(tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="archiving"))
        bars[0].update(done - bars[0].n)

    try:
        yield update
    finally:
        for bar in bars:
            bar.close()


def _inspect(path: Path, allow_custom_handlers: bool) -> int:
    """Verify like the server (into a temporary folder, removed afterwards) and print JSON."""
    from pagedserve.engine.model.archive_read import open_archive
    from pagedserve.engine.model.model_config import ModelConfig, load_model_config

    with tempfile.TemporaryDirectory(prefix="pagedserve-inspect-") as tmp:
        opened = open_archive(path, Path(tmp) / "archive", allow_custom_handlers=allow_custom_handlers)
        config = load_model_config(opened.model_config) if opened.model_config else ModelConfig()
        report = {
            "archive": str(path),
            "manifest": opened.manifest,
            "model_config": config.resolved(),
            "custom_handler": opened.custom_handler.name if opened.custom_handler else None,
        }
    print(json.dumps(report, indent=2))
    return 0
