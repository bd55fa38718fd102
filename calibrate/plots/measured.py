"""Measured figures: row statistics from calibration against the i.i.d. dilution law (theory.md sections 5-6).

* ``measured_dilution_figure``  measured top-k mass and background log-sum against the i.i.d. law
* ``dilution_table``            the same per bucket, as numbers (``format_dilution_table`` prints it)
* ``alpha_figure``              matched alpha per bucket and the three estimators' laws
* ``slope_heatmap_figure``      per-(layer, head) slopes of each estimator

Inputs are a ``RowStats`` and the ``SlopeFit`` that ``fit_slopes`` made of it, with the ``n_ref``
and ``top_k`` of that fit.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from sharpdraft_theory import alpha_law, dilution_mass, log_ratio
from sharpdraft_theory.estimators import ESTIMATORS, SlopeFit
from sharpdraft_theory.stats import RowStats

from .style import ESTIMATOR_STYLE, log_n_axis, mark_n_ref, new_figure

__all__ = ["by_length", "dilution_law", "measured_dilution_figure", "dilution_table", "format_dilution_table",
           "alpha_figure", "slope_heatmap_figure"]


def by_length(stats: RowStats, values: np.ndarray, groups: np.ndarray | None = None):
    """Mean of per-row ``values`` at each distinct n (and group): ``(n, means)``.

    ``means`` has shape (len(n),) without groups, (groups, len(n)) with them (NaN where a group has
    no row at that n). Calibration samples rows on a log grid of n, so this is the measured curve.
    """
    n_uniq, n_inv = np.unique(stats.n, return_inverse=True)
    if groups is None:
        sums = np.bincount(n_inv, weights=values, minlength=n_uniq.size)
        return n_uniq, sums / np.bincount(n_inv, minlength=n_uniq.size)
    g_uniq, g_inv = np.unique(groups, return_inverse=True)
    flat = g_inv * n_uniq.size + n_inv
    size = g_uniq.size * n_uniq.size
    with np.errstate(invalid="ignore"):
        means = np.bincount(flat, weights=values, minlength=size) / np.bincount(flat, minlength=size)
    return n_uniq, means.reshape(g_uniq.size, n_uniq.size)


def _shade_windows(ax, n_ref: int) -> None:
    ax.axvspan(n_ref / 2, n_ref, color="0.92", lw=0, label="reference window (n_ref/2, n_ref]")
    mark_n_ref(ax, n_ref)


def _per_head_law(stats: RowStats, mass: np.ndarray, n: np.ndarray, n_ref: int, top_k: int) -> np.ndarray:
    """Mean over (layer, head) of the i.i.d. dilution law anchored at each head's own mass at n_ref.

    Heads differ widely in how peaked they are, and the mean of logistic curves is not the
    logistic of the mean: this is the i.i.d. prediction for the measured mean.
    """
    sampled, head_mass = by_length(stats, mass, stats.layer * (int(stats.head.max()) + 1) + stats.head)
    m0 = np.array([np.interp(np.log(n_ref), np.log(sampled[np.isfinite(row)]), row[np.isfinite(row)])
                   for row in head_mass])
    m0 = np.clip(m0, 1e-9, 1 - 1e-9)  # sink heads put all their mass on the top set
    return dilution_mass(m0[:, None], n[None, :], n_ref, top_k).mean(axis=0)


def _gamma(fit: SlopeFit) -> float | None:
    """The dilution exponent E2 measured (slope of ln S_B(1) against ln n)."""
    return fit.result("closed-form").diagnostics.get("gamma")


def dilution_law(fit: SlopeFit, n, *, n_ref: int, top_k: int, gamma: float = 1.0) -> np.ndarray:
    """Top-k mass predicted from the measured reference mass: log-odds fall by ``gamma ln r``.

    ``gamma = 1`` is the i.i.d. law (``dilution_mass``); theory.md section 5 generalises it to a
    measured exponent.
    """
    return dilution_mass(fit.mass_ref, n, n_ref, top_k, gamma=gamma)


def measured_dilution_figure(stats: RowStats, fit: SlopeFit, *, n_ref: int, top_k: int,
                             title: str = "measured") -> Figure:
    """Measured top-k mass and background log-sum against n, with the i.i.d. law's prediction.

    Left: mean top-k mass at alpha = 1 per sampled n (thick; thin lines are layers) against the
    dilution law anchored at the measured reference mass, ``M0 / (M0 + (1 - M0) r)`` (i.i.d.
    background, gamma = 1), and the same law with the measured dilution exponent gamma (E2).
    Right: mean background log-sum ``ln S_B(1)`` relative to its value at n_ref, against the i.i.d.
    growth ``ln r`` and the measured ``gamma ln r``.
    """
    gamma = _gamma(fit)
    i1 = stats.index_of_one
    mass = stats.mass(top_k)[:, i1]
    n, mean_mass = by_length(stats, mass)
    _, layer_mass = by_length(stats, mass, stats.layer)
    n_hi = float(n.max())
    fine = np.geomspace(max(n.min(), top_k + 1), n_hi, 200)
    lr = log_ratio(fine, n_ref, top_k)  # background growth ln r, the i.i.d. log-sum rise
    fig, axes = new_figure(1, 2)
    ax_m, ax_s = axes[0]
    _shade_windows(ax_m, n_ref)
    for row in layer_mass:
        ax_m.plot(n, row, color="tab:blue", lw=0.5, alpha=0.25)
    ax_m.plot([], [], color="tab:blue", lw=0.5, alpha=0.5, label="one layer (mean over heads)")
    ax_m.plot(n, mean_mass, "o-", color="tab:blue", ms=3, lw=2, label="measured mean")
    ax_m.plot(fine, dilution_law(fit, fine, n_ref=n_ref, top_k=top_k), color="k", ls="--",
              label="i.i.d. law (gamma = 1)")
    ax_m.plot(fine, _per_head_law(stats, mass, fine, n_ref, top_k), color="0.45", ls="-.",
              label="i.i.d. law per head, averaged")
    if gamma is not None:
        ax_m.plot(fine, dilution_law(fit, fine, n_ref=n_ref, top_k=top_k, gamma=gamma), color="tab:orange",
                  label=f"measured exponent gamma = {gamma:.3f}")
    ax_m.plot([n_ref], [fit.mass_ref], "D", color="k", ms=5, label=f"reference mass {fit.mass_ref:.3f}")
    ax_m.set_ylabel(f"top-{top_k} attention mass at alpha = 1 (fraction)")
    ax_m.set_ylim(0, 1.02)
    ax_m.set_title(f"Top-{top_k} mass against n ({title})")

    log_sb = stats.background_log_sum(top_k)
    _, mean_sb = by_length(stats, log_sb)
    _, layer_sb = by_length(stats, log_sb, stats.layer)
    anchor = np.interp(np.log(n_ref), np.log(n), mean_sb)
    layer_anchor = np.array([np.interp(np.log(n_ref), np.log(n), row) for row in layer_sb])
    _shade_windows(ax_s, n_ref)
    for row, a in zip(layer_sb, layer_anchor):
        ax_s.plot(n, row - a, color="tab:blue", lw=0.5, alpha=0.25)
    ax_s.plot(n, mean_sb - anchor, "o-", color="tab:blue", ms=3, lw=2, label="measured mean")
    ax_s.plot(fine, lr, color="k", ls="--", label="i.i.d.: ln r (gamma = 1)")
    if gamma is not None:
        ax_s.plot(fine, gamma * lr, color="tab:orange", label=f"gamma ln r, gamma = {gamma:.3f}")
    ax_s.set_ylabel("ln S_B(1) - ln S_B at n_ref (nats)")
    ax_s.set_title("Background log-sum: the dilution exponent")
    for ax in (ax_m, ax_s):
        log_n_axis(ax)
        ax.legend(fontsize=8)
    fig.suptitle(f"Measured dilution against the i.i.d. law ({title}, top-{top_k}, n_ref = {n_ref})")
    return fig


def dilution_table(stats: RowStats, fit: SlopeFit, *, n_ref: int, top_k: int) -> list[dict]:
    """Per bucket from the reference window on: measured mean mass and the laws' predictions."""
    mass = stats.mass(top_k)[:, stats.index_of_one]
    gamma = _gamma(fit)
    rows = []
    for b in fit.buckets:
        if b.n <= n_ref / 2:
            continue
        n = np.array([b.n])
        rows.append(dict(n=b.n, rows=b.rows, measured=b.mass,
                         iid=float(dilution_law(fit, n, n_ref=n_ref, top_k=top_k)[0]),
                         iid_per_head=float(_per_head_law(stats, mass, n, n_ref, top_k)[0]),
                         gamma_law=None if gamma is None else float(
                             dilution_law(fit, n, n_ref=n_ref, top_k=top_k, gamma=gamma)[0]),
                         alpha=b.alpha))
    return rows


def format_dilution_table(rows: list[dict]) -> str:
    """``dilution_table`` as fixed-width text."""
    head = f"{'n':>7} {'rows':>6} {'measured':>9} {'i.i.d.':>7} {'per-head':>9} {'gamma law':>9} {'E1 alpha':>9}"
    lines = [head]
    for r in rows:
        lines.append(f"{r['n']:7.0f} {r['rows']:6d} {r['measured']:9.3f} {r['iid']:7.3f} {r['iid_per_head']:9.3f} "
                     + (f"{r['gamma_law']:9.3f}" if r["gamma_law"] is not None else f"{'-':>9}")
                     + (f" {r['alpha']:9.3f}" if r["alpha"] is not None else f" {'-':>9}"))
    return "\n".join(lines)


def alpha_figure(fit: SlopeFit, *, n_ref: int, n_max: float | None = None, title: str = "measured") -> Figure:
    """Matched query scale per bucket (E1) and the log-linear law of each estimator, against n.

    Points: per half-octave bucket past n_ref, the alpha whose mean top-k mass equals the reference
    mass (area ~ rows). Lines: ``1 + beta ln(n / n_ref)`` per estimator with its 95% bootstrap
    band; past the longest measured n (dotted line) the laws are extrapolations.
    """
    buckets = [b for b in fit.buckets if b.alpha is not None]
    n_meas = max(b.n for b in fit.buckets)
    n_max = n_max or 16 * n_meas
    n = np.geomspace(n_ref / 2, n_max, 200)
    fig, axes = new_figure(1, 1, width=7.5, height=4.8)
    ax = axes[0, 0]
    for est in ESTIMATORS:
        r = fit.result(est)
        label, colour = ESTIMATOR_STYLE[est]
        if r.slope is None:
            ax.plot([], [], color=colour, label=f"{label}: undefined ({r.note})")
            continue
        ci = f" [{r.ci_low:.3f}, {r.ci_high:.3f}]" if r.ci_low is not None else ""
        ax.plot(n, alpha_law("log-linear", n, n_ref=n_ref, slope=r.slope), color=colour,
                label=f"{label}: beta = {r.slope:.3f}{ci}")
        if r.ci_low is not None:
            ax.fill_between(n, alpha_law("log-linear", n, n_ref=n_ref, slope=r.ci_low),
                            alpha_law("log-linear", n, n_ref=n_ref, slope=r.ci_high), color=colour, alpha=0.15, lw=0)
    ax.plot(n, alpha_law("qwen-logn", n, n_ref=n_ref), color="0.5", ls=":", label="Qwen LogN (for comparison)")
    if buckets:
        rows = np.array([b.rows for b in buckets], dtype=np.float64)
        ax.scatter([b.n for b in buckets], [b.alpha for b in buckets], s=12 + 60 * rows / rows.max(),
                   color="k", zorder=3, label="E1 matched alpha per bucket")
    mark_n_ref(ax, n_ref)
    ax.axvline(n_meas, color="0.6", ls="--", lw=0.8, label=f"last measured bucket (n ~ {n_meas:.0f})")
    log_n_axis(ax)
    ax.set_ylabel("query scale alpha (multiplier)")
    ax.set_title(f"Query scale that keeps the top-k mass: alpha versus n\n{title}")
    ax.legend(fontsize=8, loc="upper left")
    return fig


def slope_heatmap_figure(fit: SlopeFit, *, title: str = "measured") -> Figure:
    """Per-(layer, head) slope of each estimator as heatmaps on one colour scale.

    ``fit`` must come from ``fit_slopes(..., granularity="head")``. Groups where an estimator is
    undefined carry the global value (``groups_filled`` in the diagnostics, printed per panel).
    """
    grids = {est: np.asarray(fit.slopes[est], dtype=np.float64) for est in ESTIMATORS}
    if any(g.ndim != 2 for g in grids.values()):
        raise ValueError("slope_heatmap_figure needs a fit from fit_slopes(..., granularity='head')")
    finite = np.concatenate([g[np.isfinite(g)] for g in grids.values()])
    vmin, vmax = (np.percentile(finite, [2, 98]) if finite.size else (0.0, 1.0))
    layers, heads = next(iter(grids.values())).shape
    fig, axes = new_figure(1, 3, width=3.0 + 0.25 * heads, height=max(3.2, 1.6 + 0.16 * layers))
    for ax, (est, grid) in zip(axes[0], grids.items()):
        im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=vmin, vmax=vmax, origin="upper",
                       interpolation="nearest")
        filled = fit.result(est).diagnostics.get("groups_filled")
        label, _ = ESTIMATOR_STYLE[est]
        ax.set_title(label + (f"\n({filled:.0f} cells = global value)" if filled else ""), fontsize=10)
        ax.set_xlabel("query head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(0, heads, max(1, heads // 10)))
        ax.set_yticks(range(0, layers, max(1, layers // 15)))
    fig.colorbar(im, ax=axes[0].tolist(), label="slope beta (per e-fold of n)", shrink=0.9)
    fig.suptitle(f"Per-head slopes ({title}; colour clipped to the 2-98% range)")
    return fig
