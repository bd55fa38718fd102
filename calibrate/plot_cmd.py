"""``sharpdraft plot``: the standard figures of a statistics file, as PNG, for readers without Jupyter."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from sharpdraft_theory.laws import MAX_N

from .errors import UserError

__all__ = ["plot"]

# Resamples for the bootstrap intervals: the interval's ends settle to about 1% by 10^4; more only costs time.
MAX_BOOTSTRAP = 10_000


def plot(
    stats: Annotated[Path, typer.Argument(help="Per-row statistics (.npz) from `sharpdraft calibrate --stats`.")],
    *,
    out: Annotated[Path, typer.Option(help="Folder for the PNG files (created if missing).")] = Path("figures"),
    n_ref: Annotated[Optional[int], typer.Option("--n-ref", help="Reference length (default: the one stored in "
                                                  "the statistics file).")] = None,
    top_k: Annotated[Optional[int], typer.Option("--top-k", help="Size of the top set (default: stored, else 4).")]
        = None,
    bootstrap: Annotated[int, typer.Option(help="Bootstrap resamples of sequences for the intervals.")] = 200,
    trained_window: Annotated[Optional[int], typer.Option(
        "--trained-window", help="Largest query-key distance the drafter was trained on, W of the dilution/drift "
                                 "verdict (default: stored, else n_ref).")] = None,
):
    """Write the standard figures: dilution curves, alpha versus n, per-head slope heatmap, attention budget,
    and dilution against distance drift (drift.png, with its verdict)."""
    from .plots import BUDGET_FIGURE, DRIFT_FIGURE, STANDARD_FIGURES, write_standard_figures
    from .preflight import check_outputs, local_inputs

    if stats.is_dir():
        raise UserError(f"statistics file {stats}: is a folder; give the .npz file `sharpdraft calibrate --stats` wrote")
    if n_ref is not None and not 2 <= n_ref <= MAX_N:
        raise UserError(f"--n-ref {n_ref}: expected an integer between 2 and 2^32")
    if top_k is not None and top_k < 1:
        raise UserError(f"--top-k {top_k}: need at least 1")
    if trained_window is not None and not 2 <= trained_window <= MAX_N:
        raise UserError(f"--trained-window {trained_window}: expected an integer between 2 and 2^32")
    if not 0 <= bootstrap <= MAX_BOOTSTRAP:
        raise UserError(f"--bootstrap {bootstrap}: expected 0 (no intervals) to {MAX_BOOTSTRAP}")
    inputs = local_inputs(stats=stats)
    check_outputs({"--out": out}, inputs, folders=("--out",))
    check_outputs({f"--out ({name})": out / name for name in (*STANDARD_FIGURES, BUDGET_FIGURE, DRIFT_FIGURE)},
                  inputs)
    try:
        paths, notes = write_standard_figures(stats, out, n_ref=n_ref, top_k=top_k, bootstrap=bootstrap,
                                              trained_window=trained_window)
    except OSError as err:
        raise UserError(f"cannot write {err.filename or out}: {err.strerror}") from None
    for path in paths:
        typer.echo(f"wrote {path}")
    for note in notes:
        typer.echo(note if note.startswith(("past n_ref", "verdict:")) else f"note: {note}")
