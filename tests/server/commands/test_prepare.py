"""`pagedserve prepare` (install time) and `pagedserve --version`.

On a machine where everything is built, `prepare` builds nothing and says that each part is
already there, and `serve`'s check before its workers start prints nothing.
"""

from __future__ import annotations

from importlib.metadata import version

import pytest

from pagedserve.server.cli import main
from pagedserve.server.commands.prepare import build_missing_kernels, cpu_extensions, prepare


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"pagedserve {version('pagedserve')}"


def test_prepare_with_everything_built_builds_nothing(default_model_dir, model_store, archive_cache, monkeypatch):
    # The store already holds smollm2.mar; its extraction is the session servers' (archive_cache).
    monkeypatch.setenv("PAGEDSERVE_ARCHIVE_DIR", str(archive_cache))
    for ext in cpu_extensions():  # built once per checkout in the shared cache (any engine does)
        if ext.load() is None:
            pytest.skip("the CPU extensions cannot be built on this machine")
    lines: list[str] = []
    prepare(model_store, out=lines.append)
    assert lines[0] == "pagedserve: CPU kernels: native already built"
    assert lines[1] == f"pagedserve: bundled model: already converted ({default_model_dir})"
    assert lines[2] == f"pagedserve: default archive: already in {model_store / 'smollm2.mar'}"
    assert lines[3].startswith(f"pagedserve: archive opened into {archive_cache}")
    assert len(lines) == 4
    printed: list[str] = []
    assert build_missing_kernels(printed.append) == []
    assert printed == []  # serve says nothing about building when nothing is built
