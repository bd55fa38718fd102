"""``sharpdraft plot``: the standard figures of a statistics file, as PNG, for readers without Jupyter."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

__all__ = ["plot"]


def plot(
    stats: Annotated[Path, typer.Argument(help="Per-row statistics (.npz) from `sharpdraft calibrate --stats`.")],
    *,
    out: Annotated[Path, typer.Option(help="Folder for the PNG files (created if missing).")] = Path("figures"),
    n_ref: Annotated[Optional[int], typer.Option("--n-ref", help="Reference length (default: the one stored in "
                                                  "the statistics file).")] = None,
    top_k: Annotated[Optional[int], typer.Option("--top-k", help="Size of the top set (default: stored, else 4).")]
        = None,
    bootstrap: Annotated[int, typer.Option(help="Bootstrap resamples of sequences for the intervals.")] = 200,
):
    """Write the standard figures: dilution curves, alpha versus n, per-head slope heatmap."""
    from .plots import write_standard_figures

    for path in write_standard_figures(stats, out, n_ref=n_ref, top_k=top_k, bootstrap=bootstrap):
        typer.echo(f"wrote {path}")
