"""The attention budget against n: how much unscaled attention goes to the sinks, the local window, the far keys.

* ``budget_curve``         per sampled n, the mean share of each key set with a 95% bootstrap interval
* ``format_budget_table``  the curve as text
* ``budget_figure``        the three shares against n, the window marked

Input: a ``RowStats`` that holds an ``AttentionBudget`` (``calibrate --stats`` records one; the key
sets are defined in ``sharpdraft_theory.stats``). Reading the figure: past ``n = S + W`` every new
key is far. Mass draining from the top set into that growing far background is dilution, which
query scaling counters (``dilution.png`` shows the top-k mass beside it); mass drifting away from
the sinks and the window is drift, which a sliding window with sinks counters.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure

from sharpdraft_theory.bootstrap import paired_bootstrap
from sharpdraft_theory.stats import BUDGET_PARTS, RowStats

from .style import log_n_axis, new_figure

__all__ = ["BudgetCurve", "budget_curve", "format_budget_table", "budget_figure"]

_COLOUR = {"sink": "tab:purple", "local": "tab:green", "far": "tab:red"}  # one per key set of BUDGET_PARTS


@dataclass(frozen=True)
class BudgetCurve:
    """Mean attention budget per sampled n over all layers, heads and sequences."""

    n: np.ndarray  # (N,) sampled visible-key counts, increasing
    rows: np.ndarray  # (N,) rows at each n
    mean: np.ndarray  # (N, 3) mean share of the sink, local and far keys (BUDGET_PARTS) over the rows at n
    low: np.ndarray  # (N, 3) 2.5% percentile of that mean over resampled sequences (NaN: no interval)
    high: np.ndarray  # (N, 3) 97.5% percentile
    sinks: int  # S of the key sets
    window: int  # W of the key sets


def budget_curve(stats: RowStats, *, bootstrap: int = 200, seed: int = 0) -> BudgetCurve:
    """The mean share of each key set per sampled n, with a 95% bootstrap interval over sequences.

    The mean at ``n`` is over every row there (layers, heads, sequences alike); the interval
    resamples the sequences holding rows at ``n`` (``paired_bootstrap``, ``bootstrap`` resamples,
    the same draws at every n and for every set). One sequence or ``bootstrap=0``: no interval.
    """
    if stats.budget is None:
        raise ValueError("these statistics hold no attention budget (written before calibration collected it)")
    n, n_at = np.unique(stats.n, return_inverse=True)
    seqs, seq_at = np.unique(stats.seq, return_inverse=True)
    cell = n_at * seqs.size + seq_at  # (rows,): one cell per (n, sequence)
    rows = np.bincount(cell, minlength=n.size * seqs.size).reshape(n.size, seqs.size)  # (N, S)
    values = np.full((len(BUDGET_PARTS), n.size, 3), np.nan)  # (part, N, [mean, lo, hi])
    for p in range(len(BUDGET_PARTS)):
        sums = np.bincount(cell, weights=stats.budget.share[:, p].astype(np.float64),
                           minlength=n.size * seqs.size).reshape(n.size, seqs.size)  # (N, S)
        for i in range(n.size):
            held = rows[i] > 0
            found = paired_bootstrap(sums[i, held], rows[i, held], resamples=bootstrap, seed=seed)
            values[p, i] = [np.nan if v is None else v for v in found]
    mean, low, high = (values[..., k].T for k in range(3))  # each (N, 3)
    return BudgetCurve(n=n, rows=rows.sum(axis=1), mean=mean, low=low, high=high, sinks=stats.budget.sinks,
                       window=stats.budget.window)


def format_budget_table(curve: BudgetCurve) -> str:
    """``budget_curve`` as fixed-width text: one line per n, each share with its interval."""
    lines = [f"{'n':>7} {'rows':>7} " + " ".join(f"{part + ' share [95%]':>22}" for part in BUDGET_PARTS)]
    for i, n in enumerate(curve.n):
        cells = []
        for p in range(len(BUDGET_PARTS)):
            interval = "" if np.isnan(curve.low[i, p]) else f" [{curve.low[i, p]:.3f}, {curve.high[i, p]:.3f}]"
            cells.append(f"{f'{curve.mean[i, p]:.3f}{interval}':>22}")
        lines.append(f"{n:7d} {curve.rows[i]:7d} " + " ".join(cells))
    return "\n".join(lines)


def budget_figure(curve: BudgetCurve, *, title: str = "measured") -> Figure:
    """The three shares against n (log axis) with their 95% bands, and a vertical line at the window W.

    Up to ``n = S + W`` there are no far keys (module docstring).
    """
    fig, axes = new_figure(1, 1, width=7.5, height=4.8)
    ax = axes[0, 0]
    labels = {"sink": f"sinks (first {curve.sinks} keys)", "local": f"local (last {curve.window} keys)",
              "far": "far (the rest)"}
    for p, part in enumerate(BUDGET_PARTS):
        ax.plot(curve.n, curve.mean[:, p], "o-", ms=3, lw=2, color=_COLOUR[part], label=labels[part])
        if np.isfinite(curve.low[:, p]).any():
            ax.fill_between(curve.n, curve.low[:, p], curve.high[:, p], color=_COLOUR[part], alpha=0.2, lw=0)
    ax.axvline(curve.window, color="0.4", ls=":", lw=1.0, label=f"window W = {curve.window}")
    log_n_axis(ax)
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("share of attention mass at alpha = 1 (fraction)")
    band = "bands: 95% bootstrap over sequences" if np.isfinite(curve.low).any() else "no bands (one sequence, or no bootstrap)"
    ax.set_title(f"Attention budget: sinks, local window, far keys ({title})\nmean over layers and heads; {band}")
    ax.legend(fontsize=8)
    return fig
