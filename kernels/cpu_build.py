"""Shared build logic for the CPU C++ extension (compiled once per machine with cpp_extension).

The project has one native extension (kernels/cpu_native.py: kernels/csrc/native.cpp and the
headers it includes), built for the portable x86-64 baseline and dispatching at run time on the
CPU's features, so a build made on one CPU runs on another. Builds go to
`$PAGEDSERVE_CACHE_DIR/torch_extensions` (default `~/.cache/pagedserve/...`), one directory per
(sources, flags, torch version, source and torch paths) so a stale build is never loaded.
`pagedserve prepare` (run by `.ci/install`) builds it at install time; a process that finds the
build missing builds it then, and says so (~1-2 min once). A finished build is marked
(`BUILT_MARK`, written after it loaded once) and later loads import its `.so` directly, without
cpp_extension's ninja check or any message.
`PAGEDSERVE_DISABLE_CPU_KERNELS=1` turns the extension off (callers then use the torch path).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

BUILT_MARK = "pagedserve_built"  # in the build folder once the extension built and loaded
BUILD_FLOCK = ".pagedserve_build.flock"  # builders of one folder take turns on it (flock)


def build_dir() -> Path:
    base = Path(os.environ.get("PAGEDSERVE_CACHE_DIR", Path.home() / ".cache" / "pagedserve"))
    return base / "torch_extensions"


def cpu_kernels_disabled() -> bool:
    return os.environ.get("PAGEDSERVE_DISABLE_CPU_KERNELS") == "1"


def build_tag(source: Path, cflags: tuple[str, ...], extra_sources: tuple[Path, ...] = ()) -> str:
    """The build folder's key: the sources and the headers beside the first (`*.h`, which they
    may include), flags, torch version, and the source's and torch's paths, which cpp_extension
    writes into build.ninja: without them two checkouts (or venvs) sharing one cache would
    rebuild the extension for each other at every load. The CPU is not part of it: the build
    targets the portable baseline and picks its instruction set at run time."""
    torch_version, torch_dir = _torch_identity()
    paths = f"{source.resolve()}:{torch_dir}".encode()
    headers = b"".join(h.name.encode() + h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    sources = b"".join(p.read_bytes() for p in (source, *extra_sources))
    key = sources + headers + repr(cflags).encode() + torch_version.encode() + paths
    return hashlib.sha256(key).hexdigest()[:10]


def _torch_identity() -> tuple[str, Path]:
    """torch's version and package folder (`torch.__version__`, the folder of `torch.__file__`),
    read from its installed metadata without importing it: whether the build exists is asked by
    the server's front end at start, which has no other use for torch (~2 s to import)."""
    from importlib.metadata import version

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise ImportError("torch is not installed")
    return version("torch"), Path(spec.origin).parent


@dataclass(frozen=True, slots=True)
class CpuExtension:
    """C++ sources compiled as Python module `pagedserve_<name>_<tag>`: `source` and any
    `extra_sources` (translation units that ninja compiles side by side, one per core).

    `cflags` should carry -fopenmp so at::parallel_for uses torch's own thread pool.
    """

    name: str
    source: Path
    cflags: tuple[str, ...]
    extra_sources: tuple[Path, ...] = ()

    @property
    def module_name(self) -> str:
        return f"pagedserve_{self.name}_{build_tag(self.source, self.cflags, self.extra_sources)}"

    @property
    def folder(self) -> Path:
        return build_dir() / f"{self.name}_{build_tag(self.source, self.cflags, self.extra_sources)}"

    @property
    def library(self) -> Path:
        return self.folder / f"{self.module_name}.so"

    def is_built(self) -> bool:
        """Built and loaded once here before (a load then needs no compiler and no message)."""
        return (self.folder / BUILT_MARK).is_file() and self.library.is_file()

    def load(self):
        """The extension module, compiling it first if needed; None if unavailable."""
        if cpu_kernels_disabled():
            return None
        import torch  # noqa: F401 - the extension links against torch's libraries: loaded first

        if self.is_built():
            try:
                return _import_built(self.module_name, self.library)
            except ImportError as exc:  # a damaged build: make it again
                logger.warning(
                    "CPU extension %s: the build in %s does not load (%s); rebuilding", self.name, self.folder, exc
                )
                (self.folder / BUILT_MARK).unlink(missing_ok=True)
        if not self.library.is_file():  # else a build without its mark: ninja checks it
            logger.warning(
                "building the CPU extension %s into %s (once per machine and checkout, "
                "~1-2 min; `pagedserve prepare` does this at install)",
                self.name,
                self.folder,
            )
        return self.build()

    def build(self):
        """Compile (or, when up to date, just load) with cpp_extension; None if unavailable.

        Builders of one folder take turns on a kernel lock (flock: released when its process
        ends, however it ends). cpp_extension's own `lock` file is not: a build killed
        mid-compile leaves it behind and every later build would wait on it forever. Holding the
        flock, no other build of the folder is running, so such a file is stale and removed."""
        import fcntl

        from torch.utils.cpp_extension import load

        folder = self.folder
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / BUILD_FLOCK, "w") as turn:
            fcntl.flock(turn, fcntl.LOCK_EX)
            if self.is_built():  # another process built it while this one waited
                return self.load()
            stale = folder / "lock"
            if stale.exists():
                logger.warning("CPU extension %s: removing %s left by a build that did not finish", self.name, stale)
                stale.unlink(missing_ok=True)
            try:
                module = load(
                    name=self.module_name,
                    sources=[str(p) for p in (self.source, *self.extra_sources)],
                    extra_cflags=list(self.cflags),
                    extra_ldflags=["-fopenmp"],  # resolves to the libgomp torch already loaded
                    build_directory=str(folder),
                    verbose=False,
                )
            except Exception as exc:  # noqa: BLE001 -- no compiler, no ninja, ...: the torch path still works
                logger.warning("CPU extension %s unavailable, using the torch path: %s", self.name, exc)
                return None
            (folder / BUILT_MARK).write_text(f"{self.module_name}.so\n")
            return module


def _import_built(module_name: str, path: Path):
    """Import a built extension the way cpp_extension does, without its ninja run."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
