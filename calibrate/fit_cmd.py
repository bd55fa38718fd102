"""``sharpdraft fit``: a thin typer command over ``calibrate.fit.fit_files``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from sharpdraft_theory.estimators import ESTIMATOR_CHOICES, get_estimator

__all__ = ["fit"]


def fit(
    stats: Annotated[list[Path], typer.Argument(help="Statistics files written by `sharpdraft calibrate --stats`.")],
    *,
    out: Annotated[Path, typer.Option("--out", help="Where to write the scale spec (JSON).")],
    n_ref: Annotated[Optional[int], typer.Option("--n-ref", help="Reference length (default: the files' own).")] = None,
    top_k: Annotated[Optional[int], typer.Option("--top-k", help="Size of the top set whose mass the slope restores "
                                                 "(default: the files' own; at most their k_max).")] = None,
    granularity: Annotated[Optional[str], typer.Option(help="Slope per global, layer or head "
                                                       "(default: the files' own).")] = None,
    estimator: Annotated[Optional[str], typer.Option(help=f"Slope written to the spec: {ESTIMATOR_CHOICES} "
                                                     "(name or label; default: the files' own).")] = None,
    alpha_max: Annotated[Optional[float], typer.Option("--alpha-max", help="Cap on alpha written to the spec "
                                                       "(default: the files' own).")] = None,
    law: Annotated[Optional[str], typer.Option(help="log-linear or tabulated (default: the files' own).")] = None,
    max_n: Annotated[Optional[int], typer.Option("--max-n", help="tabulated: extrapolate knots up to this length "
                                                 "(default: the files' own, else 64 x n_ref).")] = None,
):
    """Fit a scale spec from saved statistics, without running any model.

    Several files are fitted as one set of rows (their sequences kept distinct) when they come
    from the same drafter, sequence length, dtype and alpha grid, and from different corpora.
    """
    from .calibrate_cmd import console, print_fit
    from .errors import UserError
    from .fit import fit_files
    from .preflight import check_outputs

    if estimator is not None:
        try:
            estimator = get_estimator(estimator).name  # a label or alias (E1, closed_form, ...) to the canonical name
        except ValueError as err:
            raise UserError(f"--estimator {estimator}: {err}") from None
    check_outputs({"--out": out}, {f"statistics file {p}": p.expanduser().resolve() for p in stats if p.exists()})
    spec, result, rows, notes = fit_files(stats, n_ref=n_ref, top_k=top_k, granularity=granularity,
                                          estimator=estimator, alpha_max=alpha_max, law=law, max_n=max_n)
    try:
        spec.save(out)
    except OSError as err:
        raise UserError(f"cannot write --out {out}: {err.strerror or err}; free space or fix the path") from None
    for note in notes:
        console.print(f"[yellow]note:[/] {note}")
    c = spec.calibration
    console.print(f"Fitted {rows.rows:,} rows of {c.sequences} sequences x {c.max_length} tokens ({c.corpus}) "
                  f"from {len(stats)} file{'s' if len(stats) > 1 else ''}")
    print_fit(spec, result, out)
