"""The README's benchmark table and plot, made from the offline-throughput results files.

    python benchmarks/summary.py            # rewrite the table in README.md, write the PNG
    python benchmarks/summary.py --check    # exit 1 when README.md's table is not what the files say

Reads `benchmarks/results/offline_throughput.<cpu-kind>.json` (one current file per CPU kind,
written by benchmarks/offline_throughput.py) and writes `docs/assets/benchmarks.png`: for each
CPU kind, the engine and transformers side by side on batched throughput and batch-1 decode.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
PNG = ROOT / "docs" / "assets" / "benchmarks.png"
START, END = "<!-- benchmarks-table:start -->", "<!-- benchmarks-table:end -->"
HEADER = (
    "| CPU | throughput | vs transformers | batch-1 decode | vs transformers | TTFT 1,000 tokens |\n"
    "| --- | --- | --- | --- | --- | --- |"
)


def load_runs() -> list[dict]:
    """Every CPU kind's current offline-throughput record, sorted by CPU kind."""
    return [
        dict(json.loads(path.read_text()), kind=path.name.split(".")[1])
        for path in sorted(RESULTS.glob("offline_throughput.*.json"))
    ]


def table(runs: list[dict]) -> str:
    rows = []
    for run in runs:
        ttft = run["ttft_1000_s_median"]["engine"] * 1000
        rows.append(
            f"| {run['cpu']} | {run['engine_tok_per_s_median']:.1f} tok/s "
            f"| {run['engine_vs_hf']:.2f}x "
            f"| {run['batch1_decode_tok_per_s_median']['engine']:.1f} tok/s "
            f"| {run['batch1_decode_vs_hf']:.2f}x | {ttft:.0f} ms ({run['ttft_1000_vs_hf']:.2f}x) |"
        )
    return "\n".join([HEADER, *rows])


def with_table(readme: str, runs: list[dict]) -> str:
    head, start, rest = readme.partition(START)
    _, end, tail = rest.partition(END)
    if not start or not end:
        raise SystemExit(f"README.md has no {START} ... {END} block")
    return f"{head}{START}\n{table(runs)}\n{END}{tail}"


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    labels = [run["kind"] for run in runs]
    for ax, key, title in ((axes[0], "batched", "64 x 200 -> 128 tokens"), (axes[1], "batch1", "batch-1 decode")):
        engine = [
            r["engine_tok_per_s_median"] if key == "batched" else r["batch1_decode_tok_per_s_median"]["engine"]
            for r in runs
        ]
        hf = [r["hf_tok_per_s_median"] if key == "batched" else r["batch1_decode_tok_per_s_median"]["hf"] for r in runs]
        xs = range(len(runs))
        ax.bar([x - 0.2 for x in xs], engine, width=0.4, label="pagedserve")
        ax.bar([x + 0.2 for x in xs], hf, width=0.4, label="transformers")
        ax.set_xticks(list(xs), labels)
        ax.set_ylabel("tokens/s")
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check README.md's table")
    args = parser.parse_args(argv)
    runs = load_runs()
    if not runs:
        raise SystemExit(f"no offline_throughput.*.json in {RESULTS}")
    current = README.read_text()
    wanted = with_table(current, runs)
    if args.check:
        if wanted != current:
            print("README.md's benchmark table differs from benchmarks/results; run benchmarks/summary.py")
            return 1
        return 0
    README.write_text(wanted)
    plot(runs, PNG)
    print(f"wrote the table into {README.name} and {PNG.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
