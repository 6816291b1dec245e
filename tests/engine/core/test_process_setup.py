"""Importing an engine module loads only what it needs and changes nothing in the process;
process-wide settings (threads, seed, malloc) are applied only by the process's owner.

Each check runs in a fresh interpreter, so what the test suite imported or set before cannot
hide a heavy import or a side effect.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
# The engine package's import name, read from a module of it (the layout-independent way).
ENGINE = importlib.import_module("pagedserve.engine.kv_cache.hashing").__name__.removesuffix(".kv_cache.hashing")


def run_python(code: str, **env: str) -> dict:
    """Run `code` in a fresh interpreter at the repository root; it prints one JSON object."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        # the caller's PYTHONPATH first: a checkout run through a path shim imports its own code
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), str(ROOT)))),
            **env,
        },
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


# Imports in stages in one interpreter and reports the modules loaded after each.
_STAGES = r"""
import json, sys
stages = {}
import pagedserve.engine.kv_cache.block_pool
stages["block_pool"] = sorted(sys.modules)
from pagedserve.engine import SamplingParams
stages["sampling_params"] = sorted(sys.modules)
from pagedserve.engine import LLM, CompletionOutput, EngineConfig, RequestOutput
stages["modules_of_names"] = [c.__module__ for c in (LLM, CompletionOutput, EngineConfig, RequestOutput, SamplingParams)]
print(json.dumps(stages))
"""


def test_light_modules_load_only_what_they_need_and_offline_names_still_import():
    stages = run_python(_STAGES)
    loaded = set(stages["block_pool"])
    engine_modules = {m for m in loaded if m == ENGINE or m.startswith(f"{ENGINE}.")}
    assert engine_modules == {
        ENGINE,
        *(f"{ENGINE}.{name}" for name in ("kv_cache", "kv_cache.block_pool", "kv_cache.block", "kv_cache.hashing")),
    }
    assert not loaded & {"torch", "transformers", "pagedserve.engine.llm", "pagedserve.engine.core.engine_core"}
    loaded = set(stages["sampling_params"])
    assert "pagedserve.engine.sampling.params" in loaded and not loaded & {
        "pagedserve.engine.llm",
        "pagedserve.engine.core.engine_core",
    }
    assert stages["modules_of_names"] == [
        "pagedserve.engine.llm",
        "pagedserve.engine.request.outputs",
        "pagedserve.engine.config.engine",
        "pagedserve.engine.request.outputs",
        "pagedserve.engine.sampling.params",
    ]


# Imports every module of engine/ and kernels/ and reports what the process looks like before and
# after: torch threads, the environment, torch's RNG state, logging handlers, signal handlers.
_SIDE_EFFECTS = r"""
import hashlib, importlib, json, logging, os, signal, sys
from pathlib import Path
import torch

def snapshot():
    return {
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "env": dict(os.environ),
        "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
        "log_handlers": len(logging.getLogger().handlers),
        "root_level": logging.getLogger().level,
        "sigint": str(signal.getsignal(signal.SIGINT)),
        "default_dtype": str(torch.get_default_dtype()),
    }

before = snapshot()
# each folder's import name, read from one light module of it (the layout-independent way)
prefix = {"engine": "pagedserve.engine.kv_cache.hashing".rsplit(".", 2)[0], "kernels": "pagedserve.kernels.cpu_isa".rsplit(".", 1)[0]}
names = []
for folder, package in prefix.items():
    for path in sorted(Path(folder).rglob("*.py")):
        parts = list(path.with_suffix("").parts)[1:]
        if parts and parts[-1] == "__init__":
            parts.pop()
        names.append(".".join([package, *parts]))
imported = []
for name in names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:  # an optional package (triton, ...) absent here
        if exc.name.startswith(tuple(prefix.values())):
            raise
        continue
    imported.append(name)
print(json.dumps({"before": before, "after": snapshot(), "imported": imported}))
"""


def test_importing_every_engine_module_has_no_side_effects():
    report = run_python(_SIDE_EFFECTS)
    assert (
        "pagedserve.engine.core.engine_core" in report["imported"]
        and "pagedserve.engine.core.process" in report["imported"]
    )
    assert report["after"] == report["before"]


def test_engine_core_leaves_process_settings_to_the_owner(tiny_model_dir):
    """Building an EngineCore changes neither torch's threads nor its RNG; the owner's
    configure_engine_process applies the config's num_threads and seed."""
    report = run_python(
        f"""
import json, torch
from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.platform.process_setup import configure_engine_process
torch.set_num_threads(2)
torch.manual_seed(123)
state = torch.get_rng_state()
config = EngineConfig(model={str(tiny_model_dir)!r}, num_kv_blocks=8, block_size=4, num_threads=1, seed=7)
EngineCore(config)
after_core = [torch.get_num_threads(), torch.equal(torch.get_rng_state(), state)]
configure_engine_process(config)
seeded = torch.equal(torch.get_rng_state(), torch.Generator().manual_seed(7).get_state())
print(json.dumps({{"after_core": after_core, "after_setup": [torch.get_num_threads(), seeded]}}))
""",
        PAGEDSERVE_DISABLE_CPU_KERNELS="1",
    )  # the torch attention path is enough here
    assert report == {"after_core": [2, True], "after_setup": [1, True]}
