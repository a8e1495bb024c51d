"""The demo's loss-curve PNG: every run's loss per step on one chart.

matplotlib is optional for the library (the ``plot`` extra; ``./run.sh setup``
installs it): without it ``plot_losses`` raises ``PlotUnavailable`` saying how
to install it, and the demo goes on without the picture.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tiermem.client.demo.train import RunResult
from tiermem.core.errors import TiermemError

__all__ = ["PlotUnavailable", "plot_losses", "smooth"]


_STYLES = ("-", "--", ":", "-.")


class PlotUnavailable(TiermemError):
    """matplotlib cannot be imported."""


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over ``window`` steps (shorter at the start), the table's "mean of the last 10"."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out: list[float] = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_losses(results: Sequence[RunResult], path: str | Path, *, title: str = "", window: int = 10) -> Path:
    """Write a PNG of each run's raw loss (faint) and its ``window``-step mean; returns the absolute path."""
    if not results or not any(r.losses for r in results):
        raise ValueError("no losses to plot: every run is empty")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        from matplotlib import pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable(
            f"the loss-curve PNG needs matplotlib ({exc}); install it with: pip install 'tiermem[plot]'"
        ) from None
    out = Path(path).absolute()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        for i, r in enumerate(results):
            color, style = f"C{i}", _STYLES[i % len(_STYLES)]  # runs that agree draw on top of each other
            steps = range(1, len(r.losses) + 1)
            ax.plot(steps, r.losses, color=color, alpha=0.2, linewidth=0.8)
            ax.plot(
                steps,
                smooth(r.losses, window),
                color=color,
                linestyle=style,
                linewidth=1.6,
                label=f"{r.name} ({r.final_loss:.4f})",
            )
        ax.set_xlabel("step")
        ax.set_ylabel(f"training loss (faint: per step; line: mean of {window})")
        ax.set_title(title or "tiermem demo: the same model, data and seed under each optimizer")
        ax.grid(alpha=0.3)
        ax.legend(title="run (final loss)")
        fig.tight_layout()
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)
    return out
