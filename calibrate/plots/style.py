"""What every figure shares: the Agg canvas, the log-n axis, the n_ref mark, estimator colours, PNG output.

Figures are drawn on the Agg canvas (no pyplot, no display needed). n (visible keys, tokens) is
always on a log-2 axis labelled in tokens (512, 4k, 64k, 1M with k = 1024).
"""

from __future__ import annotations

import os
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from sharpdraft_theory.atomic import atomic_path

__all__ = ["ESTIMATOR_STYLE", "N_LABEL", "new_figure", "token_label", "log_n_axis", "mark_n_ref", "save_figure"]

ESTIMATOR_STYLE = {  # estimator -> (label, colour)
    "mass-matching": ("E1 mass matching", "tab:blue"),
    "closed-form": ("E2 closed form", "tab:orange"),
    "gaussian": ("E3 Gaussian fit", "tab:green"),
}
N_LABEL = "visible keys n (tokens, log scale)"


def new_figure(nrows: int = 1, ncols: int = 1, *, width: float = 6.0, height: float = 4.2):
    """A constrained-layout figure on the Agg canvas and its (nrows, ncols) axes array."""
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def token_label(x, _pos=None) -> str:
    """Tick label for a length: 512, 4k, 64k, 1M (k = 1024)."""
    for unit, div in (("M", 1 << 20), ("k", 1 << 10)):
        if x >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def log_n_axis(ax, label: str = N_LABEL) -> None:
    """Log-2 x axis with token-count tick labels."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(LogLocator(base=2, numticks=12))
    ax.xaxis.set_major_formatter(FuncFormatter(token_label))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(label)
    ax.grid(True, which="major", alpha=0.3)


def mark_n_ref(ax, n_ref: int) -> None:
    """A dotted vertical line at the reference length."""
    ax.axvline(n_ref, color="0.4", ls=":", lw=1.0, label=f"n_ref = {n_ref}")


def save_figure(fig: Figure, path: str | os.PathLike, *, dpi: int = 130) -> Path:
    """Write ``fig`` as PNG atomically (a reader never sees half a file); returns the path."""
    path = Path(path)
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    return path
