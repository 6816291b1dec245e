"""`pagedserve prepare`: build at install time what a first start would otherwise build.

`.ci/install` runs it after pip install, so that `pagedserve serve` is ready within seconds
from its very first start. It fills the caches under `$PAGEDSERVE_CACHE_DIR`
(`~/.cache/pagedserve`) and the model store:

1. the CPU C++ kernels (`kernels/csrc`, one extension compiled with torch's cpp_extension, ~1-2 min),
2. the bundled model converted from its GGUF to a model directory (~20 s),
3. that model archived into the store as `smollm2.mar` (what `serve --models default` registers),
4. the archive opened (verified and extracted) into the archive cache, as `serve` opens it.

Each step that finds its result already there says so and does nothing. `serve` calls
`build_missing_kernels` before its workers start, so a machine where the install did not run
still starts (with a clear message about what it builds, once), and one where it ran prints
nothing about building.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

Out = Callable[[str], None]


def cpu_extensions():
    """The CPU extensions the engine loads (empty when PAGEDSERVE_DISABLE_CPU_KERNELS=1): the one
    native extension, every kernel in it."""
    from pagedserve.kernels.cpu_build import cpu_kernels_disabled
    from pagedserve.kernels.cpu_native import EXTENSION as NATIVE

    return () if cpu_kernels_disabled() else (NATIVE,)


def build_missing_kernels(out: Out, *, why: str = "") -> list[str]:
    """Build the CPU extensions not built yet, saying what and why; their names."""
    missing = [ext for ext in cpu_extensions() if not ext.is_built()]
    for ext in missing:
        if ext.library.is_file():  # built before builds were marked: cpp_extension checks it
            out(f"pagedserve: checking the earlier build of the CPU kernel {ext.name} in {ext.folder}")
        else:
            out(
                f"pagedserve: building the CPU kernel {ext.name} into {ext.folder} "
                f"(once per machine and checkout, ~1-2 min{why})"
            )
        start = time.perf_counter()
        if ext.build() is None:
            out(
                f"pagedserve: the CPU kernel {ext.name} could not be built (see the warning "
                "above); the engine uses its plain-torch path"
            )
        else:
            out(f"pagedserve: {ext.name} ready in {time.perf_counter() - start:.0f} s")
    return [ext.name for ext in missing]


def prepare(store: Path, out: Out = print) -> None:
    """Steps 1-4 of the module docstring; each one reports what it did or found."""
    from pagedserve.engine.model.default_model import default_model_dir, is_converted

    if not build_missing_kernels(out):
        names = ", ".join(ext.name for ext in cpu_extensions())
        out(
            f"pagedserve: CPU kernels: {names or 'off (PAGEDSERVE_DISABLE_CPU_KERNELS=1)'}"
            f"{' already built' if names else ''}"
        )
    if is_converted():
        out(f"pagedserve: bundled model: already converted ({default_model_dir()})")
    else:
        out("pagedserve: converting the bundled model (GGUF -> safetensors, once, ~20 s)")
        start = time.perf_counter()
        out(f"pagedserve: converted into {default_model_dir()} in {time.perf_counter() - start:.0f} s")
    from pagedserve.server.app.startup import DEFAULT_ARCHIVE_NAME, ensure_default_archive
    from pagedserve.server.workers.archives import load_archive

    archive = store / f"{DEFAULT_ARCHIVE_NAME}.mar"
    if archive.exists():
        out(f"pagedserve: default archive: already in {archive}")
    ensure_default_archive(store)  # prints its own line when it writes the archive
    start = time.perf_counter()
    opened = load_archive(archive.resolve(), allow_custom_handlers=False)
    out(f"pagedserve: archive opened into {opened.model_dir} ({time.perf_counter() - start:.1f} s)")


def add_prepare_parser(sub) -> None:
    p = sub.add_parser(
        "prepare",
        help="build the CPU kernels and convert and archive the bundled model (install time)",
        description="Build at install time what a first `serve` would otherwise build: the CPU "
        "kernels, the bundled model's conversion, its archive in the model store and "
        "its extraction. .ci/install runs it; running it again does nothing.",
    )
    p.add_argument(
        "--model-store", metavar="DIR", default="model_store", help="where to write smollm2.mar (default: model_store)"
    )
    p.set_defaults(func=_run)


def _run(args) -> int:
    prepare(Path(args.model_store))
    return 0
