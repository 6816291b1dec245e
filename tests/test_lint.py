"""The house rules, checked by their tools: the import contracts (`lint-imports`: the four layers,
no HTTP below the handlers, no import circles inside any package), `ruff check`, `ruff format
--check`, `mypy` on engine/ and server/, and a front end that imports no torch."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run(*argv: str, cwd: Path = REPO, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


COMMANDS = {  # each tool run by this interpreter, so it sees the environment the tests see
    "lint-imports": (
        "importlinter",
        ["-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"],
    ),
    "ruff": ("ruff", ["-m", "ruff"]),
    "mypy": ("mypy", ["-m", "mypy"]),
}


def tool(name: str) -> list[str]:
    module, argv = COMMANDS[name]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return [sys.executable, *argv]


def test_import_contracts_are_kept():
    out = run(*tool("lint-imports"))
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_the_circle_contract_catches_a_type_only_circle(tmp_path):
    """The acyclic contract as configured here refuses a circle made only of TYPE_CHECKING
    imports, like the ones this codebase had (pagedserve.engine.request.request <-> pagedserve.engine.structured_output.manager)."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text(
        textwrap.dedent("""\
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from pkg import a
        """)
    )
    (tmp_path / ".importlinter").write_text(
        textwrap.dedent("""\
        [importlinter]
        root_package = pkg

        [importlinter:contract:circles]
        name = no circles
        type = acyclic_siblings
        ancestors = pkg
        """)
    )
    out = run(*tool("lint-imports"), cwd=tmp_path)
    assert out.returncode != 0 and "No cycles are allowed in pkg" in out.stdout, out.stdout


def test_ruff_check_is_clean():
    out = run(*tool("ruff"), "check", ".")
    assert out.returncode == 0, out.stdout[-6000:]


def test_ruff_format_is_clean():
    out = run(*tool("ruff"), "format", "--check", ".")
    assert out.returncode == 0, out.stdout[-6000:]


@pytest.mark.slow
def test_mypy_is_clean_on_engine_and_server(tmp_path):
    """mypy over engine/ and server/ (pyproject's [tool.mypy]), every module checked: there is no
    baseline of excused modules. Under the `pagedserve` namespace the folders are reached through a link
    tree (`pagedserve/engine` -> engine/ ...), as mypy does not read the editable install's
    package-dir mapping."""
    if importlib.util.find_spec("pagedserve") is None:
        targets = ["engine", "server"]
        cwd, env_path = REPO, str(REPO)
    else:
        tree = tmp_path / "pagedserve"
        tree.mkdir()
        for root in ("server", "handlers", "engine", "kernels"):
            (tree / root).symlink_to(REPO / root, target_is_directory=True)
        targets = ["-p", "pagedserve.engine", "-p", "pagedserve.server"]
        cwd, env_path = REPO, str(tmp_path)
    out = subprocess.run(
        [*tool("mypy"), "--config-file", str(REPO / "pyproject.toml"), *targets],
        cwd=cwd,
        env={**os.environ, "MYPYPATH": env_path},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-6000:]


FRONT_END_STEPS = """
import pagedserve.server.cli, pagedserve.server.app.serve, pagedserve.server.app.inference, pagedserve.server.management.app
from pagedserve.engine.model.registry import parse_config
from pagedserve.server.commands.prepare import cpu_extensions
from pagedserve.engine.platform.worker_start import gpu_driver_present
from pagedserve.server.workers.devices import visible_gpus
import json, struct, sys, tempfile
from pathlib import Path
from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.model.default_model import default_gguf_path
from pagedserve.server.workers.memory_budget import path_sizes, version_sizes

pagedserve.server.cli.build_parser()
config = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}
parse_config(config)
[ext.is_built() for ext in cpu_extensions()]
if not gpu_driver_present():
    assert visible_gpus() == 0
# the memory budget of a model folder (safetensors headers, the KV pool) and of a GGUF file
folder = Path(tempfile.mkdtemp())
(folder / "config.json").write_text(json.dumps(config))
header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}}).encode()
(folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
weights, kv = version_sizes(EngineConfig(model=str(folder), dtype="bfloat16", num_kv_blocks=10))
assert (weights, kv) == (32, 10 * 2 * 2 * 16 * 2 * 16 * 2), (weights, kv)
assert path_sizes(default_gguf_path(), EngineConfig(model="m", dtype="float32"))[0] > 100 << 20
"""


def test_the_front_end_imports_no_torch():
    """The front end's modules (the CLI, the app and every route) load without torch: the
    engine's data types it uses are plain, and torch is imported where tensors are made. So do
    the steps a server's start and the archive CLI take before any worker: the CLI's parser, the
    model registry (a config parsed by its family), the check that the CPU kernels are built,
    the GPU count on a machine without a GPU driver, and the memory budget of a model to
    register (its weights and KV pool, from a folder and from a GGUF file)."""
    out = run(sys.executable, "-X", "importtime", "-c", FRONT_END_STEPS)
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line]
    assert "pagedserve.server.app.inference" in loaded  # the import really happened
    assert not [name for name in loaded if name == "torch" or name.startswith("torch.")]
