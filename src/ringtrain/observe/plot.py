"""The doctor's picture: device busy over time per rank, and the stacked step breakdown.

Needs matplotlib (the optional extra ``ringtrain[plot]``); :func:`available` says
whether it is installed, and the doctor prints a hint instead of the PNG when not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ringtrain.observe.meter import PARALLEL_PHASES, PHASES

__all__ = ["available", "plot_reports"]

_COLOURS = {
    "data_wait": "#d62728", "h2d_copy": "#ff9896", "compute": "#2ca02c",
    "exchange_wait": "#1f77b4", "update": "#9467bd",
    # model parallelism's own waits (carved out of compute by the meter)
    "shard_comm": "#17becf", "pipeline_bubble": "#bcbd22",
}


def _phase_ms(report: dict[str, Any], name: str) -> float:
    summary = report["summary"]
    if name in PHASES:
        return 1e3 * float(summary["phases_s"][name])
    return 1e3 * float(((summary.get("parallel") or {}).get(name) or {}).get("s", 0.0))


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_reports(reports: list[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Write the PNG for the ranks' reports; returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed (CI, ssh)
    import matplotlib.pyplot as plt

    reports = sorted(reports, key=lambda r: r["rank"])
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(10, 7), gridspec_kw={"height_ratios": [3, 2]}, constrained_layout=True)

    for rep in reports:
        s = rep["series"]
        warm = rep["summary"].get("warmup", 0)
        pts = [(t, b) for i, t, b in zip(s["index"], s["t"], s["busy"], strict=False) if i >= warm]
        if pts:
            xs, ys = zip(*pts, strict=False)
            line, = top.step(xs, [100 * y for y in ys], where="post",
                             label=f"rank {rep['rank']} (per step)")
            gpu = rep.get("gpu_series")
            if gpu and gpu.get("t"):
                top.plot(gpu["t"], gpu["util"], linestyle=":", color=line.get_color(),
                         label=f"rank {rep['rank']} GPU utilisation (NVML)")
    top.set_ylim(0, 105)
    top.set_xlabel("seconds since the first step")
    top.set_ylabel("device busy (%)")
    top.axhline(95, color="grey", linewidth=0.8, linestyle="--")
    top.grid(alpha=0.3)
    top.legend(loc="lower right", fontsize=8)
    top.set_title(title or "device busy over time", fontsize=10)

    labels = [f"rank {r['rank']}" for r in reports]
    left = [0.0] * len(reports)
    shown = [*PHASES, *(n for n in PARALLEL_PHASES if any(_phase_ms(r, n) > 0 for r in reports))]
    for name in shown:
        widths = [_phase_ms(r, name) for r in reports]
        bottom.barh(labels, widths, left=left, color=_COLOURS[name], height=0.6,
                    label=name.replace("_", " "))
        left = [a + b for a, b in zip(left, widths, strict=False)]
    bottom.invert_yaxis()
    bottom.set_xlabel("mean milliseconds per step")
    bottom.set_title("where a step's time goes", fontsize=10)
    bottom.legend(loc="upper center", bbox_to_anchor=(0.5, -0.28), fontsize=8,
                  ncol=len(shown), frameon=False)
    bottom.grid(axis="x", alpha=0.3)

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target
