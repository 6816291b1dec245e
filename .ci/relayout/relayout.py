#!/usr/bin/env python3
"""pagedserve's mechanical re-layout (issue 30, items 0 and 3), re-runnable on a merged main.

    python3 .ci/relayout/relayout.py [--repo PATH] [--dry-run]

What it does, in order (each step is a no-op where it is already done, so a second run changes
nothing):

1. Moves files by the MAPPING table below with `git mv`: server/ split by concern into
   subpackages, engine/'s loose root files grouped by concept, tests mirroring them. New
   packages get an `__init__.py`. Files that the table does not name and that lie loose in
   server/ or engine/ (other than the entry points) are REPORTED at the end: extend the table
   and run the script again.
2. One import namespace: every project module `X` (server, handlers, engine, kernels) becomes
   `pagedserve.X` (setuptools package-dir mapping: the folders stay at the top level; see
   setup.py, written here). Every import statement, dotted module string (`-m pagedserve.server.cli`,
   mock/patch targets, logger names, entry points, import-linter contracts, mypy overrides) and
   file path (`engine/runner/model_runner.py` in docs and comments) is rewritten by the same table.
3. kernels/__init__.py is removed: the top-level `kernels/` folder is then only a namespace
   portion, and a regular package of the same name (Hugging Face's `kernels`, a transformers
   dependency) always wins over it, whatever sys.path holds (a repo-root sys.path entry added by
   `python -m pytest` included). pagedserve's own code reaches it as `pagedserve.kernels`.
4. Packaging and tool configs: setup.py (the package-dir mapping and package data), pyproject's
   entry point, import-linter root packages and contracts, ruff's first-party names, mypy's
   module names; `kernels` (Hugging Face's) joins the test extra for the wheel test.
5. `ruff check --fix --select I` (import order only) and `ruff format` over the tree (the formatting of the whole codebase is
   done here, once, after all branches are merged).

It prints every move, every rewritten file count and the unmapped loose files.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

ROOTS = ("server", "handlers", "engine", "kernels")
NAMESPACE = "pagedserve"

# old path -> new path (files, or whole folders), relative to the repository root.
MAPPING: dict[str, str] = {
    # server/ is layered bottom-up, package by package (the acyclic contract checks it):
    # common <- workers <- metrics <- serving <- (torchserve, kserve, management) <- app <- commands
    # --- server/common: what every part uses: errors, atomic writes, keys, settings, OpenAPI
    "server/common/errors.py": "server/common/errors.py",
    "server/common/safe_write.py": "server/common/safe_write.py",
    "server/common/auth.py": "server/common/auth.py",
    "server/common/config.py": "server/common/config.py",
    "server/common/openapi.py": "server/common/openapi.py",
    "server/common/keep_alive.py": "server/common/keep_alive.py",
    # --- server/workers: models -> versions -> workers, archives, lifecycle, memory, routing ---
    "server/workers/registry.py": "server/workers/registry.py",
    "server/workers/pool.py": "server/workers/pool.py",
    "server/workers/lifecycle.py": "server/workers/lifecycle.py",
    "server/workers/memory_budget.py": "server/workers/memory_budget.py",
    "server/workers/routing.py": "server/workers/routing.py",
    "server/workers/adapters.py": "server/workers/adapters.py",
    "server/workers/archives.py": "server/workers/archives.py",
    "server/workers/snapshot.py": "server/workers/snapshot.py",
    "server/workers/params.py": "server/workers/params.py",
    "server/workers/devices.py": "server/workers/devices.py",
    # --- server/metrics ---------------------------------------------------------------------
    "server/metrics/families.py": "server/metrics/families.py",
    "server/metrics/vllm.py": "server/metrics/vllm.py",
    # --- server/serving: what every route's request goes through: the server state, the one
    # generation path (prepare -> respond, whole or streamed, shaped), limits, error middleware
    "server/serving/state.py": "server/serving/state.py",
    "server/serving/generation.py": "server/serving/generation.py",
    "server/serving/fanout.py": "server/serving/fanout.py",
    "server/serving/shapers.py": "server/serving/shapers.py",
    "server/serving/streaming.py": "server/serving/streaming.py",
    "server/serving/limits.py": "server/serving/limits.py",
    "server/serving/middleware.py": "server/serving/middleware.py",
    "server/serving/connections.py": "server/serving/connections.py",
    "server/serving/body_encoding.py": "server/serving/body_encoding.py",
    "server/serving/request_scope.py": "server/serving/request_scope.py",
    # --- API surfaces (ollama/ and anthropic/ arrive as packages already) --------------------
    "server/torchserve/bodies.py": "server/torchserve/bodies.py",
    "server/kserve/routes.py": "server/kserve/routes.py",
    "server/management/app.py": "server/management/app.py",
    "server/management/lifecycle_routes.py": "server/management/lifecycle_routes.py",
    # --- the console (management port): its module next to its static files ------------------
    "server/console/app.py": "server/console/app.py",
    "server/console/history.py": "server/console/history.py",
    "server/console/console_static": "server/console/console_static",
    # --- server/app: the three apps assembled and run -----------------------------------------
    "server/app/serve.py": "server/app/serve.py",
    "server/app/inference.py": "server/app/inference.py",
    # --- server/commands: the CLI's commands (server/cli.py, the dispatcher, stays) ------------
    "server/commands/serve.py": "server/commands/serve.py",
    "server/commands/archive.py": "server/commands/archive.py",
    "server/commands/prepare.py": "server/commands/prepare.py",
    "server/commands/bench": "server/commands/bench",
    # --- engine/config: every engine-side config schema and the schema helpers -----------------
    "engine/config/engine.py": "engine/config/engine.py",
    "engine/config/schema.py": "engine/config/schema.py",
    "engine/config/kv_offload.py": "engine/config/kv_offload.py",
    "engine/config/speculative.py": "engine/config/speculative.py",
    # --- engine/request: a request and its outputs ------------------------------------------------
    "engine/request/request.py": "engine/request/request.py",
    "engine/request/inputs.py": "engine/request/inputs.py",
    "engine/request/outputs.py": "engine/request/outputs.py",
    "engine/request/detokenizer.py": "engine/request/detokenizer.py",
    "engine/request/stop_strings.py": "engine/request/stop_strings.py",
    "engine/request/pooling.py": "engine/request/pooling.py",
    # --- engine/sampling ----------------------------------------------------------------------------
    "engine/sampling/params.py": "engine/sampling/params.py",
    "engine/sampling/sampler.py": "engine/sampling/sampler.py",
    "engine/sampling/metadata.py": "engine/sampling/metadata.py",
    "engine/sampling/logits_processors.py": "engine/sampling/logits_processors.py",
    # --- engine/structured_output ---------------------------------------------------------------------
    "engine/structured_output/manager.py": "engine/structured_output/manager.py",
    "engine/structured_output/params.py": "engine/structured_output/params.py",
    "engine/structured_output/limits.py": "engine/structured_output/limits.py",
    # --- engine/core: the engine core, its process, its clients, their messages ---------------------
    "engine/core/engine_core.py": "engine/core/engine_core.py",
    "engine/core/process.py": "engine/core/process.py",
    "engine/core/client.py": "engine/core/client.py",
    "engine/core/messages.py": "engine/core/messages.py",
    "engine/core/async_llm.py": "engine/core/async_llm.py",
    "engine/core/output_processor.py": "engine/core/output_processor.py",
    # --- engine/runner: the model runner and its persistent input batch -------------------------------
    "engine/runner/model_runner.py": "engine/runner/model_runner.py",
    "engine/runner/input_batch.py": "engine/runner/input_batch.py",
    # --- engine/platform: the process's settings (threads, seeds, malloc, memory) ----------------------
    "engine/platform/process_setup.py": "engine/platform/process_setup.py",
    # --- tests mirror the layout ---------------------------------------------------------------
    "tests/engine/core/test_async_llm.py": "tests/engine/core/test_async_llm.py",
    "tests/engine/core/test_async_scheduling.py": "tests/engine/core/test_async_scheduling.py",
    "tests/engine/core/test_heartbeat.py": "tests/engine/core/test_heartbeat.py",
    "tests/engine/core/test_process_setup.py": "tests/engine/core/test_process_setup.py",
    "tests/engine/core/test_worker_refusals.py": "tests/engine/core/test_worker_refusals.py",
    "tests/engine/core/test_output_protocol.py": "tests/engine/core/test_output_protocol.py",
    "tests/engine/core/test_engine_invariants.py": "tests/engine/core/test_engine_invariants.py",
    "tests/engine/request/test_inputs.py": "tests/engine/request/test_inputs.py",
    "tests/engine/request/test_detokenizer.py": "tests/engine/request/test_detokenizer.py",
    "tests/engine/request/test_detokenizer_sentencepiece.py": "tests/engine/request/test_detokenizer_sentencepiece.py",
    "tests/engine/request/test_stop_strings.py": "tests/engine/request/test_stop_strings.py",
    "tests/engine/request/test_pooling.py": "tests/engine/request/test_pooling.py",
    "tests/engine/sampling/test_sampler.py": "tests/engine/sampling/test_sampler.py",
    "tests/engine/sampling/test_logit_bias.py": "tests/engine/sampling/test_logit_bias.py",
    "tests/engine/structured_output/test_structured_output.py": "tests/engine/structured_output/test_structured_output.py",
    "tests/engine/runner/test_input_batch.py": "tests/engine/runner/test_input_batch.py",
    "tests/engine/config/test_config.py": "tests/engine/config/test_config.py",
    "tests/engine/core/test_output_processor.py": "tests/engine/core/test_output_processor.py",
    "tests/engine/kv_cache/test_block_pool.py": "tests/engine/kv_cache/test_block_pool.py",
    "tests/engine/kv_cache/test_hashing.py": "tests/engine/kv_cache/test_hashing.py",
    "tests/engine/kv_cache/test_kv_manager.py": "tests/engine/kv_cache/test_kv_manager.py",
    "tests/engine/scheduler/test_scheduler.py": "tests/engine/scheduler/test_scheduler.py",
    "tests/server/kserve/test_kserve.py": "tests/server/kserve/test_kserve.py",
    "tests/server/management/test_management.py": "tests/server/management/test_management.py",
    "tests/server/management/test_management_archives.py": "tests/server/management/test_management_archives.py",
    "tests/server/management/test_management_auth.py": "tests/server/management/test_management_auth.py",
    "tests/server/metrics/test_metrics.py": "tests/server/metrics/test_metrics.py",
    "tests/server/metrics/test_metrics_offload.py": "tests/server/metrics/test_metrics_offload.py",
    "tests/server/metrics/test_metrics_vllm.py": "tests/server/metrics/test_metrics_vllm.py",
    "tests/server/workers/test_routing.py": "tests/server/workers/test_routing.py",
    "tests/server/workers/test_worker_restart.py": "tests/server/workers/test_worker_restart.py",
    "tests/server/workers/test_worker_threads.py": "tests/server/workers/test_worker_threads.py",
    "tests/server/workers/test_registry_hardening.py": "tests/server/workers/test_registry_hardening.py",
    "tests/server/workers/test_model_lifecycle.py": "tests/server/workers/test_model_lifecycle.py",
    "tests/server/commands/test_archive_cli.py": "tests/server/commands/test_archive_cli.py",
    "tests/server/commands/test_prepare.py": "tests/server/commands/test_prepare.py",
    "tests/server/commands/test_bench.py": "tests/server/commands/test_bench.py",
}

# Files that stay at a package's root: its entry points (named in ARCHITECTURE.md).
ENTRY_POINTS = {"server/__init__.py", "server/cli.py", "engine/__init__.py", "engine/llm.py"}

PACKAGE_DOCS = {
    "server/common": "What every part of the front end uses: errors, atomic writes, keys, settings, connections, OpenAPI.",
    "server/serving": "What every route's request goes through: the server state, the one generation path (prepare, respond whole or streamed, shape), limits, the error middleware.",
    "server/app": "The three apps (inference, management, metrics) assembled, started, drained.",
    "server/torchserve": "TorchServe's /predictions surface: request bodies (JSON, text, forms, uploads).",
    "server/kserve": "KServe's v1 and open-inference v2 surface.",
    "server/management": "TorchServe's management API: its routes and the lifecycle routes.",
    "server/console": "The console on the management port: its routes, its history, its static files.",
    "server/workers": "Models -> versions -> workers: the registry, worker pools, routing, lifecycle, memory budget, archives, adapters, snapshots.",
    "server/metrics": "The metrics port: pagedserve's families and vLLM's names.",
    "server/commands": "The CLI's commands (serve, archive, prepare, bench); server/cli.py dispatches to them.",
    "engine/request": "A request and its outputs: inputs (prepare), the request's state, detokenizing, stop strings, pooling.",
    "engine/sampling": "Sampling: the parameters (SamplingParams), their per-step metadata, logits processors, the sampler.",
    "engine/structured_output": "Structured output: the constraint (params and limits) and the grammar manager (xgrammar).",
    "engine/core": "The engine core, its process (busy loop, socket threads), its clients, wire messages and the output processor.",
    "engine/platform": "The engine process's settings: threads, seeds, malloc tuning, resident memory.",
    "engine/runner": "The model runner and its persistent input batch.",
    "engine/config": "The engine-side config schemas (EngineConfig, kv_offload, speculative) and the schema helpers.",
}

TEXT_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".cfg", ".ini", ".txt", ".json", ".service", ".sh", ".in", ""}
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", "model_store", "site"}


def sh(*argv: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, check=check, capture_output=True, text=True)


def module_of(path: str) -> str | None:
    """'engine/kv_cache/block.py' -> 'pagedserve.engine.kv_cache.block' ('x/__init__.py' -> 'x')."""
    p = Path(path)
    if p.suffix != ".py" or not p.parts or p.parts[0] not in ROOTS + ("tests",):
        return None
    parts = list(p.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def new_path_of(path: str) -> str:
    """Where `path` goes under MAPPING (a folder's mapping carries its contents)."""
    if path in MAPPING:
        return MAPPING[path]
    for old, new in MAPPING.items():
        if path.startswith(old + "/"):
            return new + path[len(old) :]
    return path


def tracked_files(repo: Path) -> list[str]:
    out = sh("git", "ls-files", "-co", "--exclude-standard", cwd=repo).stdout.split("\n")
    return [f for f in out if f and (repo / f).is_file() and not set(Path(f).parts) & SKIP_DIRS]


# --------------------------------------------------------------------------- step 1: moves
def move_files(repo: Path, dry: bool) -> list[tuple[str, str]]:
    moves = []
    for old, new in MAPPING.items():
        src, dst = repo / old, repo / new
        if not src.exists() or dst.exists():
            continue
        moves.append((old, new))
        print(f"git mv {old} {new}")
        if dry:
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        sh("git", "mv", old, new, cwd=repo)
    if not dry:
        for new in {str(Path(n).parent) for _, n in moves} | {str(Path(n)) for _, n in moves if (repo / n).is_dir()}:
            _ensure_packages(repo, new)
    return moves


def _ensure_packages(repo: Path, folder: str) -> None:
    """Every folder from a root down to `folder` is a package (kernels excepted, see step 3)."""
    parts = Path(folder).parts
    for i in range(1, len(parts) + 1):
        d = Path(*parts[:i])
        if d.parts[0] not in ROOTS + ("tests",) or d == Path("kernels") or not (repo / d).is_dir():
            continue
        init = repo / d / "__init__.py"
        if not init.exists():
            doc = PACKAGE_DOCS.get(str(d), "")
            init.write_text(f'"""{doc}"""\n' if doc else "")
            sh("git", "add", str(init.relative_to(repo)), cwd=repo)


# ---------------------------------------------------------------- step 2: the rename table
def module_table(repo: Path, files_before: list[str]) -> dict[str, str]:
    """old dotted module -> new dotted module: every current module of the four roots (and of
    tests, which keep no namespace), then MAPPING's own entries, which win (so that a file
    merged in after a first run, still naming `pagedserve.server.workers.pool`, gets `pagedserve.server.workers.pool.pool`)."""
    table: dict[str, str] = {}

    def ns(module: str) -> str:
        return module if module.split(".")[0] == "tests" else f"{NAMESPACE}.{module}"

    for f in files_before:
        old = module_of(f)
        if old is not None:
            table[old] = ns(module_of(new_path_of(f)) or old)
    for old, new in MAPPING.items():
        if old.endswith(".py"):
            table[module_of(old)] = ns(module_of(new))
        else:  # a folder moved whole: its package name
            table[old.replace("/", ".")] = ns(new.replace("/", "."))
    for root in ROOTS:
        table[root] = f"{NAMESPACE}.{root}"
    return table


def path_table(files_before: list[str]) -> dict[str, str]:
    table = {f: new_path_of(f) for f in files_before if new_path_of(f) != f}
    for old, new in MAPPING.items():  # folders, written as `server/commands/bench/`
        table.setdefault(old, new)
    return table


_DOTTED = re.compile(r"(?<![\w.])((?:server|handlers|engine|kernels|tests)(?:\.[A-Za-z_]\w*)+)")
_PATH = re.compile(r"(?<![\w./-])((?:server|handlers|engine|kernels|tests)/[\w./-]*\w)")


def rewrite_dotted(text: str, modules: dict[str, str]) -> str:
    """Every dotted name whose first two or more parts name a project module: that prefix
    renamed (`-m pagedserve.server.cli`, "pagedserve.engine.core.process" logger names, patch targets)."""

    def repl(m: re.Match) -> str:
        name = m.group(1)
        parts = name.split(".")
        for k in range(len(parts), 1, -1):
            prefix = ".".join(parts[:k])
            if prefix in modules:
                return ".".join([modules[prefix], *parts[k:]])
        return name

    return _DOTTED.sub(repl, text)


def rewrite_paths(text: str, paths: dict[str, str]) -> str:
    def repl(m: re.Match) -> str:
        p = m.group(1)
        trail = ""
        while p and p[-1] in ".":
            p, trail = p[:-1], p[-1] + trail
        if p in paths:
            return paths[p] + trail
        for old, new in paths.items():
            if p.startswith(old + "/"):
                return new + p[len(old) :] + trail
        return m.group(1)

    return _PATH.sub(repl, text)


def rewrite_imports(source: str, modules: dict[str, str], own_module: str | None) -> str:
    """Import statements of project modules, rewritten through the table; relative imports in
    test files made absolute first. Formatting is ruff's job afterwards."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, int, int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                if own_module is None:
                    continue
                pkg = own_module.split(".")[: -node.level]
                base = ".".join([*pkg, base] if base else pkg)
            top = base.split(".")[0]
            if top not in ROOTS + ("tests",):
                continue
            groups: dict[str, list[str]] = {}
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in modules and _parent(modules[full]) != modules.get(base, base):
                    new_full = modules[full]
                    groups.setdefault(_parent(new_full), []).append(_alias(_leaf(new_full), alias, alias.name))
                else:
                    groups.setdefault(modules.get(base, _rename_prefix(base, modules)), []).append(
                        _alias(alias.name, alias, alias.name)
                    )
            indent = " " * node.col_offset
            text = "\n".join(
                f"{indent if i else ''}from {mod} import {', '.join(names)}"
                for i, (mod, names) in enumerate(groups.items())
            )
            edits.append((node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, text))
        elif isinstance(node, ast.Import):
            names, changed = [], False
            for alias in node.names:
                new = _rename_prefix(alias.name, modules) if alias.name.split(".")[0] in ROOTS else alias.name
                changed |= new != alias.name
                names.append(f"{new} as {alias.asname}" if alias.asname else new)
            if changed:
                edits.append(
                    (node.lineno, node.col_offset, node.end_lineno, node.end_col_offset, f"import {', '.join(names)}")
                )
    for lineno, col, end_lineno, end_col, text in sorted(edits, reverse=True):
        first, last = lines[lineno - 1], lines[end_lineno - 1]
        lines[lineno - 1 : end_lineno] = [first[:col] + text + last[end_col:]]
    return "".join(lines)


def _rename_prefix(name: str, modules: dict[str, str]) -> str:
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        prefix = ".".join(parts[:k])
        if prefix in modules:
            return ".".join([modules[prefix], *parts[k:]])
    return name


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _leaf(name: str) -> str:
    return name.rpartition(".")[2]


def _alias(name: str, alias: ast.alias, bound: str) -> str:
    target = alias.asname or bound
    return name if target == name else f"{name} as {target}"


def _rewrite_text(text: str, modules: dict[str, str], paths: dict[str, str]) -> str:
    text = rewrite_dotted(text, modules)
    text = rewrite_paths(text, paths)
    text = re.sub(r"(?<![\w.])from (server|handlers|engine|kernels) import\b", rf"from {NAMESPACE}.\1 import", text)
    return re.sub(r"(?<![\w.])import (server|handlers|engine|kernels)\s*$", rf"import {NAMESPACE}.\1", text, flags=re.M)


def rewrite_python_text(source: str, rewrite) -> str:
    """`rewrite` applied to the string literals and comments of a Python source only: in code, a
    name such as `pagedserve.server.common.config` is a variable's attribute, not a module."""
    import io
    import tokenize

    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return source
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    out, pos = [], 0
    for tok in tokens:
        if tok.type not in (tokenize.STRING, tokenize.COMMENT):
            continue
        start = offsets[tok.start[0] - 1] + tok.start[1]
        end = offsets[tok.end[0] - 1] + tok.end[1]
        out.append(source[pos:start])
        out.append(rewrite(source[start:end]))
        pos = end
    out.append(source[pos:])
    return "".join(out)


def adjust_parents(text: str, delta: int) -> str:
    """`Path(__file__)...parents[k]` in a test file moved `delta` folders deeper."""
    if not delta:
        return text
    return re.sub(
        r"(__file__\)(?:\.resolve\(\))?\.parents\[)(\d+)\]", lambda m: f"{m.group(1)}{int(m.group(2)) + delta}]", text
    )


def rewrite_tree(repo: Path, modules: dict[str, str], paths: dict[str, str], moves: dict[str, str], dry: bool) -> int:
    changed = 0
    for f in tracked_files(repo):
        p = repo / f
        if p.suffix not in TEXT_SUFFIXES and p.name not in ("Dockerfile",):
            continue
        if f.startswith("benchmarks/results/") or f.endswith(".lock"):
            continue
        try:
            text = p.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        new = text
        if p.suffix == ".py":
            own = module_of(f)
            old_f = next((o for o, n in moves.items() if n == f), f)
            own_old = module_of(old_f)
            new = rewrite_imports(new, modules, own_old or own)
            depth = len(Path(f).parts) - len(Path(old_f).parts)
            new = adjust_parents(new, depth)
        if p.suffix == ".py":
            new = rewrite_python_text(new, lambda s: _rewrite_text(s, modules, paths))
        else:
            new = _rewrite_text(new, modules, paths)
        if new != text:
            changed += 1
            if not dry:
                p.write_text(new)
    return changed


# ---------------------------------------------------------- step 3 and 4: packaging, tools
SETUP_PY = '''"""Packaging: one import namespace, `pagedserve`, over the top-level folders (package-dir
mapping; the same for the editable install and the wheel). Metadata is in pyproject.toml."""

from setuptools import find_namespace_packages, setup

ROOTS = ("server", "handlers", "engine", "kernels")
packages = [
    f"pagedserve.{name}"
    for name in find_namespace_packages(include=[*ROOTS, *(f"{root}.*" for root in ROOTS)], exclude=["*.__pycache__"])
]

setup(
    packages=packages,
    package_dir={f"pagedserve.{root}": root for root in ROOTS},
    package_data={"": ["*.cpp", "*.h", "*.json", "*.yaml", "*.html", "*.js", "*.css", "*.jinja", "py.typed"]},
    include_package_data=True,
)
'''


def packaging(repo: Path, dry: bool) -> None:
    init = repo / "kernels" / "__init__.py"
    if init.exists():
        if init.read_text().strip():
            print("NOTE: kernels/__init__.py is not empty; its content is dropped with it:\n" + init.read_text())
        print("git rm kernels/__init__.py")
        if not dry:
            sh("git", "rm", "-q", "kernels/__init__.py", cwd=repo)
    if not dry and not (repo / "setup.py").exists():
        (repo / "setup.py").write_text(SETUP_PY)
        sh("git", "add", "setup.py", cwd=repo)
        wheel_test = Path(__file__).resolve().parent / "test_wheel.py"
        if not (repo / "tests" / "test_wheel.py").exists():
            (repo / "tests" / "test_wheel.py").write_text(wheel_test.read_text())
            sh("git", "add", "tests/test_wheel.py", cwd=repo)
    dockerfile = repo / "config" / "deploy" / "Dockerfile"
    if dockerfile.exists() and not dry:
        docker = dockerfile.read_text()
        if "setup.py" not in docker:
            dockerfile.write_text(
                docker.replace("COPY pyproject.toml README.md ./", "COPY pyproject.toml setup.py README.md ./")
            )
    pyproject = repo / "pyproject.toml"
    text = pyproject.read_text()
    text = re.sub(r"\[tool\.setuptools\.packages\.find\]\ninclude = \[[^\]]*\]\n", "", text)
    text = _import_contracts(text)
    text = text.replace(
        'known-first-party = ["server", "handlers", "engine", "kernels", "tests"]',
        'known-first-party = ["pagedserve", "tests"]',
    )
    text = text.replace('files = ["engine", "server"]\n', "")
    if '"kernels>=' not in text:  # Hugging Face's kernels, beside which the wheel test imports ours
        text = text.replace(
            '    "peft>=0.17",\n',
            '    "peft>=0.17",\n    # Hugging Face\'s `kernels` (a transformers extra): the wheel test imports it beside ours\n'
            '    "kernels>=0.10",\n',
            1,
        )
    if not dry:
        pyproject.write_text(text)


ARCH_SECTION = """
## Packaging and the import namespace

Everything importable lives under one name, `pagedserve` (`pagedserve.server`,
`pagedserve.handlers`, `pagedserve.engine`, `pagedserve.kernels`), while the folders stay at the
top level. `setup.py` maps each `pagedserve.<root>` to its folder (setuptools' `package_dir`),
the same for the editable install (`pip install -e .`: a finder maps the names to the folders)
and for a wheel (the files are written under `pagedserve/`); `pagedserve` itself is a namespace
package with no folder of its own. A wheel therefore never writes a top-level `kernels/`,
`server/`, `engine/` or `handlers/` into site-packages, and installs beside Hugging Face's
`kernels` (a transformers dependency) without touching it (`tests/test_wheel.py` builds the
wheel, installs it into a fresh venv beside transformers and `kernels`, and from a folder
outside the repository imports both and loads a model through transformers).

Tests run from the repository root, and `python -m pytest` puts that folder on `sys.path`.
The top-level `kernels/` folder has no `__init__.py`: it is only a namespace portion, and a
regular package of the same name (Hugging Face's) always wins over a namespace portion,
wherever the two sit on `sys.path`; pagedserve's code names it `pagedserve.kernels` only.
`server/`, `engine/` and `handlers/` keep their `__init__.py` (their names collide with no
dependency) but nothing imports them by the bare name.

Entry points, the only files at the roots of `server/` and `engine/`: `server/__init__.py`,
`server/cli.py` (the `pagedserve` command, `python -m pagedserve.server.cli`),
`engine/__init__.py` (`from pagedserve.engine import LLM, SamplingParams`) and `engine/llm.py`
(the offline `LLM`).
"""


def architecture(repo: Path, dry: bool) -> None:
    path = repo / "ARCHITECTURE.md"
    if dry or not path.exists():
        return
    text = path.read_text()
    if "## Packaging and the import namespace" not in text:
        marker = "## Layering rules"
        text = text.replace(marker, ARCH_SECTION.lstrip() + "\n" + marker, 1) if marker in text else text + ARCH_SECTION
        path.write_text(text)


CONTRACTS = """[tool.importlinter]
root_packages = ["pagedserve.server", "pagedserve.handlers", "pagedserve.engine", "pagedserve.kernels"]
include_external_packages = true

[[tool.importlinter.contracts]]
name = "Layers: server -> handlers -> engine, never back up"
type = "layers"
layers = ["pagedserve.server", "pagedserve.handlers", "pagedserve.engine"]

# pagedserve.kernels is a namespace package (no __init__.py, see ARCHITECTURE.md), which a
# layers contract cannot name: its rule, the bottom layer's, is written as a forbidden contract.
[[tool.importlinter.contracts]]
name = "Kernels: the bottom layer imports no other layer"
type = "forbidden"
source_modules = ["pagedserve.kernels.*"]
forbidden_modules = ["pagedserve.engine", "pagedserve.handlers", "pagedserve.server"]

[[tool.importlinter.contracts]]
name = "The engine and the kernels speak no HTTP"
type = "forbidden"
source_modules = ["pagedserve.engine", "pagedserve.kernels.*"]
forbidden_modules = ["aiohttp"]

[[tool.importlinter.contracts]]
name = "No import circles among the modules and subpackages of any package"
type = "acyclic_siblings"
ancestors = ["pagedserve.server", "pagedserve.handlers", "pagedserve.engine"]
"""


def _import_contracts(text: str) -> str:
    """The import-linter section over the namespace; the acyclic contract's ignore_imports (the
    open circles, already renamed) are kept."""
    start = text.find("[tool.importlinter]")
    if start < 0 or "pagedserve.server" in text[start : start + 200]:
        return text
    end = text.find("\n[tool.", text.find("ancestors", start))
    section = text[start : end if end >= 0 else len(text)]
    ignore = section[section.find("# Circles still open") :] if "ignore_imports" in section else ""
    return text[:start] + CONTRACTS + ignore.rstrip() + "\n" + (text[end:] if end >= 0 else "")


def ruff(repo: Path, dry: bool) -> None:
    if dry:
        return
    bin_dir = Path(sys.executable).parent
    tool = bin_dir / "ruff"
    if not tool.exists():
        print("ruff not found beside this python: run `ruff check --fix . && ruff format .` yourself")
        return
    for argv in ([str(tool), "check", "--fix", "--select", "I", "."], [str(tool), "format", "."]):
        out = sh(*argv, cwd=repo, check=False)
        print(" ".join(argv[1:]), "->", (out.stdout.strip().splitlines() or [""])[-1])


def unmapped_loose_files(repo: Path) -> list[str]:
    loose = []
    for root in ("server", "engine"):
        for p in sorted((repo / root).glob("*.py")):
            rel = str(p.relative_to(repo))
            if rel not in ENTRY_POINTS:
                loose.append(rel)
    return loose


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default=".", help="the checkout to re-lay (default: here)")
    ap.add_argument("--dry-run", action="store_true", help="print the moves, change nothing")
    args = ap.parse_args(argv)
    repo = Path(args.repo).resolve()
    if not (repo / ".git").exists() or not (repo / "server").is_dir():
        print(f"{repo} is not a pagedserve checkout", file=sys.stderr)
        return 2
    files_before = tracked_files(repo)
    already = any(f.startswith("setup.py") for f in files_before) and not (repo / "kernels/__init__.py").exists()
    modules = module_table(repo, files_before)
    paths = path_table(files_before)
    moves = move_files(repo, args.dry_run)
    if already and not moves:
        print("already re-laid out; rewriting references that a later merge may have brought in")
    changed = rewrite_tree(repo, modules, paths, {o: n for o, n in moves}, args.dry_run)
    print(f"rewrote references in {changed} files")
    packaging(repo, args.dry_run)
    architecture(repo, args.dry_run)
    ruff(repo, args.dry_run)
    loose = unmapped_loose_files(repo)
    if loose:
        print("\nUNMAPPED loose files (add them to MAPPING and run again):")
        for f in loose:
            print("   ", f)
    print("\nnext: pip install -e '.[test]' (the package layout changed), then the tests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
