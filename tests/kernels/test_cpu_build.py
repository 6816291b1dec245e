"""The CPU extensions' build folders: one per source content, flags and checkout; a built one
loads directly (no cpp_extension, no message)."""

from __future__ import annotations

import logging

import pytest

from pagedserve.kernels.cpu_build import build_tag

FLAGS = ("-O3", "-fopenmp")


def test_the_tag_follows_content_flags_and_the_source_path(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        (folder / "k.cpp").write_text("int f() { return 1; }\n")
    assert build_tag(a / "k.cpp", FLAGS) == build_tag(a / "k.cpp", FLAGS)
    # Another checkout of the same source: build.ninja would name other paths, so another folder.
    assert build_tag(a / "k.cpp", FLAGS) != build_tag(b / "k.cpp", FLAGS)
    assert build_tag(a / "k.cpp", FLAGS) != build_tag(a / "k.cpp", ("-O2", "-fopenmp"))
    before = build_tag(a / "k.cpp", FLAGS)
    (a / "k.cpp").write_text("int f() { return 2; }\n")
    assert build_tag(a / "k.cpp", FLAGS) != before


def test_an_empty_cache_has_nothing_built_and_disabled_kernels_load_as_none(tmp_path, monkeypatch):
    from pagedserve.kernels.cpu_native import EXTENSION

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    assert EXTENSION.folder.parent == tmp_path / "torch_extensions"
    assert not EXTENSION.is_built()
    monkeypatch.setenv("PAGEDSERVE_DISABLE_CPU_KERNELS", "1")
    assert EXTENSION.load() is None
    assert not (tmp_path / "torch_extensions").exists()  # nothing was built


def test_a_built_extension_loads_without_cpp_extension_and_without_a_message(monkeypatch, caplog):
    from torch.utils import cpp_extension

    from pagedserve.kernels.cpu_native import EXTENSION

    if EXTENSION.load() is None:  # built here once (shared cache) unless there is no compiler
        pytest.skip("the CPU extension cannot be built on this machine")
    assert EXTENSION.is_built()

    def no_build(*args, **kwargs):
        raise AssertionError("a built extension must not go through cpp_extension")

    monkeypatch.setattr(cpp_extension, "load", no_build)
    with caplog.at_level(logging.DEBUG, logger="pagedserve.kernels.cpu_build"):
        module = EXTENSION.load()
    assert callable(module.paged_decode_attention)
    assert caplog.records == []


PYBIND_ONLY = """
#include <pybind11/pybind11.h>
int answer() { return 42; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""


def test_a_lock_left_by_a_killed_build_does_not_stall_the_next_build(tmp_path, monkeypatch):
    """cpp_extension waits forever on a `lock` file a killed build left; the build removes it
    (it holds the folder's flock, so no other build is running) and builds."""
    import subprocess
    import sys
    import textwrap

    (tmp_path / "k.cpp").write_text(PYBIND_ONLY)
    script = textwrap.dedent(f"""
        from pathlib import Path
        from pagedserve.kernels.cpu_build import CpuExtension
        ext = CpuExtension("stale_lock_test", Path({str(tmp_path / "k.cpp")!r}), ("-O0",))
        ext.folder.mkdir(parents=True)
        (ext.folder / "lock").write_text("")  # what a build killed mid-compile leaves
        module = ext.build()
        assert module is not None and module.answer() == 42
        assert not (ext.folder / "lock").exists() and ext.is_built()
        print("built")
    """)
    env = {**__import__("os").environ, "PAGEDSERVE_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("PAGEDSERVE_DISABLE_CPU_KERNELS", None)
    # Before the fix this waited on the lock for ever: the timeout turns that into a failure.
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "built" in done.stdout, done.stderr[-2000:]
