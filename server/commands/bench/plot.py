"""The throughput-latency curve of a sweep as a PNG (matplotlib's object API and Agg canvas:
no pyplot, no global backend switch)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def plot_curve(
    levels: Sequence[dict],
    path: str | Path,
    title: str,
    x_key: str = "output_throughput",
    x_label: str = "output throughput (tokens/s)",
    panels: Sequence[tuple[str, str]] = (
        ("e2el_ms", "end-to-end latency (ms)"),
        ("ttft_ms", "time to first token (ms)"),
        ("tpot_ms", "time per output token (ms)"),
    ),
) -> Path:
    """One subplot per latency in `panels` (median and the highest percentile against `x_key`),
    each point labelled with its level (`level` of each entry). Returns the PNG's path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(6.5, 5 * len(panels)), 4.2), dpi=100)
    FigureCanvasAgg(fig)
    xs = [lv[x_key] for lv in levels]
    for i, (key, label) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        dist = [lv[key] for lv in levels]
        top = max((k for k in dist[0] if k.startswith("p")), key=lambda k: float(k[1:]), default=None) if dist else None
        ax.plot(xs, [d["median"] for d in dist], "o-", label="median")
        if top is not None:
            ax.plot(xs, [d[top] for d in dist], "s--", label=top)
        for x, d, lv in zip(xs, dist, levels):
            ax.annotate(str(lv["level"]), (x, d["median"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel(x_label)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path
