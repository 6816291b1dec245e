"""The README is a front door and the documentation site builds: `mkdocs build --strict` (broken
links, missing pages and a schema the reference generator cannot read all fail it), the README's
two set-up commands are what CI runs, and its benchmark table is what the results files say."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_README_LINES = 200


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= MAX_README_LINES


def test_readme_set_up_commands_are_what_ci_runs():
    """The README's second command is exactly `.ci/run`'s (after the install, which both run);
    the first command's serve part is run by tests/server/test_docs_examples.py."""
    block = re.search(r"## Two commands.*?```bash\n(.*?)```", README.read_text(), re.DOTALL)[1]
    serve, test = block.strip().splitlines()
    assert serve == "bash .ci/install && .venv/bin/pagedserve serve --models default"
    assert test.startswith("bash .ci/install && ")
    assert test in (REPO / ".ci" / "run").read_text().splitlines()


def test_readme_benchmark_table_matches_the_results_files():
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "summary.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (REPO / "docs" / "assets" / "benchmarks.png").stat().st_size > 1000


def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    env = {**os.environ, "PYTHONPATH": str(REPO), "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    page = (tmp_path / "site" / "configuration" / "index.html").read_text()
    # the reference is generated from the declarations: every declared key is on the page
    from pagedserve.engine.config.engine import EngineFields
    from pagedserve.engine.config.kv_offload import KVOffloadConfig
    from pagedserve.engine.model.model_config import ModelConfigFile
    from pagedserve.server.common.config import ServerConfig

    for schema in (EngineFields, KVOffloadConfig, ModelConfigFile, ServerConfig):
        for field in msgspec.structs.fields(schema):
            assert f"<code>{field.encode_name}</code>" in page, (schema.__name__, field.encode_name)
    assert "tokens per KV block; a power of two" in page  # a field's source comment is its text
    architecture = (tmp_path / "site" / "architecture" / "index.html").read_text()
    assert 'class="mermaid"' in architecture
