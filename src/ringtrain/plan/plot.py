"""Efficiency-vs-GPUs chart. matplotlib is optional (``pip install 'ringtrain[plot]'``)."""

from __future__ import annotations

from pathlib import Path

from ringtrain.errors import ConfigError
from ringtrain.plan.simulate import StepBreakdown

__all__ = ["plot_efficiency"]


def plot_efficiency(results: dict[str, list[StepBreakdown]], path: str | Path, title: str) -> Path:
    """Write a PNG of scaling efficiency against GPU count, one line per strategy."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed, none opened
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib; install it with: pip install 'ringtrain[plot]'") from None
    out = Path(path)
    if out.is_dir():  # before the suffix: '/tmp' would become '/tmp.png' beside it
        raise ConfigError(f"--plot {path!r} is a folder; give a file path inside it, e.g. {out / 'efficiency.png'}")
    # savefig picks the format from the suffix and appends ".png" to a bare name: say so
    # up front, and report the file it really writes.
    if not out.suffix:
        out = out.with_name(out.name + ".png")
    if out.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ConfigError(f"--plot {path!r}: write a .png, .svg or .pdf path, e.g. efficiency.png")
    if out.is_dir():
        raise ConfigError(f"--plot {path!r} is a folder; give a file path inside it, e.g. {out / 'efficiency.png'}")
    if not out.parent.exists():
        raise ConfigError(f"--plot: folder {str(out.parent)!r} does not exist; create it or choose another path")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        for name, rows in results.items():
            ax.plot([r.gpus for r in rows], [100 * r.efficiency for r in rows], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("scaling efficiency (%)")
        ax.set_ylim(0, 105)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        ax.set_title(title)
        fig.tight_layout()
        fig.savefig(out, dpi=120)
    finally:
        plt.close(fig)
    return out
