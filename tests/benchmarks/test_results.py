"""benchmarks/results/ holds one current file per benchmark and CPU kind (the history is in git):
every file is `<benchmark>.<cpu-kind>.<md|json>`, `<benchmark>` a script in benchmarks/ or a name
a script writes, `<cpu-kind>` a name the harness's cpu_kind() gives, and every .md names the
commit and the CPU it was measured at."""

from __future__ import annotations

import re
from pathlib import Path

from pagedserve.server.commands.bench.harness import CPU_KINDS, cpu_kind

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RESULTS = BENCHMARKS / "results"
FILE = re.compile(r"(?P<name>[a-z0-9_]+)\.(?P<kind>[a-z0-9-]+)\.(?P<ext>md|json)")
COMMIT = re.compile(r"\bcommit\b[^\n]*?\b[0-9a-f]{7,40}\b", re.IGNORECASE)
CPU = re.compile(r"\b(Intel|AMD|Xeon|EPYC|Ryzen|Zen ?[0-9]|Arm|Neoverse|Graviton|Apple M[0-9])\b")


def results_files() -> list[Path]:
    """The committed kind of file: a script's hidden scratch files (`.name...`) are not results."""
    return sorted(p for p in RESULTS.iterdir() if not p.name.startswith("."))


def scripts() -> dict[str, str]:
    return {p.stem: p.read_text() for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_")}


def written_by_a_script(name: str, sources: dict[str, str]) -> bool:
    """A script's own name, a variant of it (`<script>_<variant>`: its --name/--out option, or a
    name per dtype), or a name a script spells out (`result_path("compile", ...)`)."""
    return any(name == stem or name.startswith(stem + "_") or f'"{name}"' in text for stem, text in sources.items())


def test_every_results_file_is_one_benchmark_on_one_cpu_kind():
    sources = scripts()
    files = results_files()
    assert files
    bad = []
    for path in files:
        m = FILE.fullmatch(path.name)
        if m is None:
            bad.append(f"{path.name}: not <benchmark>.<cpu-kind>.<md|json>")
        elif m["kind"] not in CPU_KINDS:
            bad.append(f"{path.name}: {m['kind']!r} is not one of cpu_kind()'s names {CPU_KINDS}")
        elif not written_by_a_script(m["name"], sources):
            bad.append(f"{path.name}: no script in benchmarks/ writes {m['name']!r}")
    assert not bad, "\n".join(bad)
    assert cpu_kind() in CPU_KINDS


def test_every_results_page_names_its_commit_and_cpu_and_its_cpu_matches_the_kind():
    bad = []
    for path in results_files():
        if path.suffix != ".md":
            continue
        text = path.read_text()
        kind = path.name.split(".")[1]
        if not COMMIT.search(text):
            bad.append(f"{path.name}: names no commit")
        if not CPU.search(text):
            bad.append(f"{path.name}: names no CPU")
        # the file measured on an AMX Xeon before that kind had its own name went under `xeon`
        if kind == "xeon" and "amx_bf16" in text:
            bad.append(f"{path.name}: measured on a CPU with amx_bf16: its kind is xeon-amx")
    assert not bad, "\n".join(bad)


def test_the_rule_catches_a_stray_file():
    sources = scripts()
    assert written_by_a_script("offline_throughput", sources)
    assert written_by_a_script("fused_decode_bfloat16", sources)
    assert not written_by_a_script("suite_time", sources)
    assert FILE.fullmatch("lora.unrecorded.md")["kind"] not in CPU_KINDS
    assert FILE.fullmatch("tensor_parallel_1thread.md") is None
