"""Figures of attention-mass dilution and its correction: theory against measurement.

Every function returns a ``matplotlib.figure.Figure`` drawn on the Agg canvas (no pyplot, no
display needed), so the notebooks, ``sharpdraft plot`` and the tests share one implementation.
The math lives in ``sharpdraft_theory``; this module only evaluates it and draws.

Theory (score models, docs/theory.md sections 2-4):

* ``dilution_law_figure``   top-k mass against n for several gaps, spreads and k (annealed law)
* ``quenched_figure``       annealed formula against quenched Monte Carlo, regimes shaded
* ``correction_figure``     exact correction against the tangent and least-squares slopes
* ``horizon_figure``        the correction horizon and the slopes across the background spread

Measurement (``RowStats`` from calibration, ``SlopeFit`` from ``fit_slopes``, section 5-6):

* ``measured_dilution_figure``  measured top-k mass and background log-sum against the i.i.d. law
* ``alpha_figure``              matched alpha per bucket and the three estimators' laws
* ``slope_heatmap_figure``      per-(layer, head) slopes of each estimator
* ``estimator_figure``          per-layer slopes of the three estimators, head-level agreement
* ``assumption_figure``         where A1-A3 and the Gaussian background fail, per layer

Conventions: n (visible keys, tokens) is always on a log axis; slopes are per e-fold of n.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
from scipy.special import expit, logit

from sharpdraft_theory import (Gaussian, ScoreModel, alpha_law, annealed_mass, dilution_mass, exact_alpha, horizon_n,
                               least_squares_slope, log_ratio, monte_carlo_mass, regime, tangent_slope)
from sharpdraft_theory.atomic import atomic_path
from sharpdraft_theory.estimators import ESTIMATORS, SlopeFit, fit_slopes
from sharpdraft_theory.stats import RowStats

from .errors import UserError

__all__ = [
    "dilution_law_figure", "quenched_figure", "correction_figure", "horizon_figure",
    "measured_dilution_figure", "alpha_figure", "slope_heatmap_figure", "estimator_figure", "assumption_figure",
    "LayerDiagnostics", "layer_diagnostics", "by_length", "dilution_law", "save_figure", "load_stats",
    "write_standard_figures", "STANDARD_FIGURES", "describe_stats", "dilution_table", "format_dilution_table",
    "format_results", "format_failures",
]

#: File names ``sharpdraft plot`` writes, in order.
STANDARD_FIGURES = ("dilution.png", "alpha.png", "slope_heatmap.png")

_EST_STYLE = {  # estimator -> (label, colour)
    "mass-matching": ("E1 mass matching", "tab:blue"),
    "closed-form": ("E2 closed form", "tab:orange"),
    "gaussian": ("E3 Gaussian fit", "tab:green"),
}
_REGIME_COLOUR = {"annealed": "#e8f4e8", "crossover": "#fdf1d8", "frozen": "#f9dede"}
DEFAULT_TOP_K = 4  # calibration's default --top-k
_N_LABEL = "visible keys n (tokens, log scale)"


# -- drawing helpers -------------------------------------------------------------------------------
def _figure(nrows: int = 1, ncols: int = 1, *, width: float = 6.0, height: float = 4.2):
    """A constrained-layout figure on the Agg canvas and its (nrows, ncols) axes array."""
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def _tokens(x, _pos=None) -> str:
    """Tick label for a length: 512, 4k, 64k, 1M (k = 1024)."""
    for unit, div in (("M", 1 << 20), ("k", 1 << 10)):
        if x >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def _log_n_axis(ax, label: str = _N_LABEL) -> None:
    """Log-2 x axis with token-count tick labels."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(LogLocator(base=2, numticks=12))
    ax.xaxis.set_major_formatter(FuncFormatter(_tokens))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(label)
    ax.grid(True, which="major", alpha=0.3)


def _mark_n_ref(ax, n_ref: int) -> None:
    ax.axvline(n_ref, color="0.4", ls=":", lw=1.0, label=f"n_ref = {n_ref}")


def save_figure(fig: Figure, path: str | os.PathLike, *, dpi: int = 130) -> Path:
    """Write ``fig`` as PNG atomically (a reader never sees half a file); returns the path."""
    path = Path(path)
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    return path


# -- theory ----------------------------------------------------------------------------------------
def dilution_law_figure(panels: Mapping[str, Mapping[str, ScoreModel]], *, n_ref: int, n_max: float) -> Figure:
    """Annealed top-k mass (alpha = 1) against n, one panel per family of score models.

    Parameters
    ----------
    panels : mapping title -> (mapping label -> ScoreModel)
        E.g. ``{"gap D (sigma 1, k 4)": {"D = 4": Gaussian(4, 1, 4), ...}, ...}``.
    n_ref : int
        Reference length, marked on each panel.
    n_max : float
        Longest length drawn.

    Notes
    -----
    Under A1-A3 ``M_k(n) = expit(g(1) - ln(n - k))``: every curve is the same logistic in ln n,
    shifted by the model's ``g(1)`` (the log-odds fall one unit per e-fold of background keys).
    """
    fig, axes = _figure(1, len(panels), width=4.6)
    for ax, (title, models) in zip(axes[0], panels.items()):
        for label, model in models.items():
            n = np.geomspace(model.top_k + 1, n_max, 200)
            ax.plot(n, annealed_mass(model, n), label=label)
        _mark_n_ref(ax, n_ref)
        _log_n_axis(ax)
        ax.set_ylim(0, 1.02)
        ax.set_title(title)
        ax.set_ylabel("top-k attention mass M_k (fraction)")
        ax.legend(fontsize=8)
    fig.suptitle("Dilution law: top-k mass against context length (annealed, alpha = 1)")
    return fig


def _shade_regimes(ax, model: ScoreModel, n: np.ndarray, alpha) -> None:
    """Background colour per regime of the annealed sum along the x axis."""
    labels = np.broadcast_to(regime(model, n, alpha), n.shape)
    start = 0
    for i in range(1, n.size + 1):
        if i == n.size or labels[i] != labels[start]:
            ax.axvspan(n[start], n[min(i, n.size - 1)], color=_REGIME_COLOUR.get(str(labels[start]), "white"), lw=0)
            start = i


def _regime_legend(ax, extra_handles) -> None:
    patches = [Patch(color=c, label=f"{name} regime") for name, c in _REGIME_COLOUR.items()]
    ax.legend(handles=list(extra_handles) + patches, fontsize=8, loc="best")


def quenched_figure(models: Mapping[str, ScoreModel], *, n: Sequence[int], alpha: float = 1.0, rows: int = 256,
                    seed: int = 0) -> Figure:
    """Annealed top-k log-odds against quenched Monte Carlo at the lengths ``n``, regimes shaded.

    The shading is ``sharpdraft_theory.regime``: where the annealed sum A3 holds (green), drifts
    (amber) or fails because a few background terms dominate the sum (red, frozen). Log-odds
    rather than mass, because near mass 1 (the frozen side) the gap is invisible in mass. Monte
    Carlo points are ``logit`` of the mean mass with two standard errors (delta method).
    """
    n = np.asarray(n, dtype=np.int64)
    fig, axes = _figure(1, len(models), width=4.6)
    for ax, (label, model) in zip(axes[0], models.items()):
        fine = np.geomspace(max(model.top_k + 2, n.min() / 1.5), n.max() * 1.5, 160)
        _shade_regimes(ax, model, fine, alpha)
        (line,) = ax.plot(fine, logit(annealed_mass(model, fine, alpha)), color="k", label="annealed formula")
        mc = np.array([monte_carlo_mass(model, int(v), alpha, rows=rows, seed=seed) for v in n])  # (len(n), 2)
        mean = np.clip(mc[:, 0], 1e-12, 1 - 1e-12)
        points = ax.errorbar(n, logit(mean), yerr=2 * mc[:, 1] / (mean * (1 - mean)), fmt="o", ms=4,
                             color="tab:red", capsize=2, label=f"Monte Carlo ({rows} rows)")
        _log_n_axis(ax)
        ax.set_xlim(fine[0], fine[-1])
        ax.set_title(label)
        ax.set_ylabel(f"top-k log-odds ln(M / (1 - M)) at alpha = {alpha:g} (nats)")
        _regime_legend(ax, [line, points])
    fig.suptitle("Annealed formula against quenched Monte Carlo (one nat of log-odds per e-fold of n)")
    return fig


def _laws(model: ScoreModel, n_ref: int, n_max: float) -> dict:
    """Exact correction, tangent and least-squares slopes, and the horizon, for one model."""
    corr = exact_alpha(model, np.geomspace(n_ref, n_max, 200), n_ref)
    beta_t = tangent_slope(model)
    try:
        beta_ls = least_squares_slope(model, n_ref, min(n_max, corr.horizon_n * 0.999))
    except ValueError:  # horizon at or below n_ref: nothing to fit
        beta_ls = None
    return dict(corr=corr, beta_t=beta_t, beta_ls=beta_ls)


def correction_figure(model: ScoreModel, *, n_ref: int, n_max: float, mc_n: Sequence[int] = (), mc_rows: int = 0,
                      seed: int = 0, title: str | None = None) -> Figure:
    """Query scale and resulting top-k mass: exact correction, tangent slope, least-squares slope.

    Left: ``alpha(n)``. Right: annealed top-k mass under each law, with the target (the mass at
    ``n_ref``) and, when ``mc_rows > 0``, quenched Monte Carlo checks at ``mc_n``. A finite
    correction horizon inside the range is drawn as a red line.
    """
    laws = _laws(model, n_ref, n_max)
    corr, beta_t, beta_ls = laws["corr"], laws["beta_t"], laws["beta_ls"]
    n = corr.n
    alphas = {"exact a*(n)": corr.alpha,
              f"tangent slope {beta_t:.3f}": alpha_law("log-linear", n, n_ref=n_ref, slope=beta_t)}
    if beta_ls is not None:
        alphas[f"least-squares slope {beta_ls:.3f}"] = alpha_law("log-linear", n, n_ref=n_ref, slope=beta_ls)
    styles = {0: dict(color="k", lw=2), 1: dict(color="tab:blue", ls="--"), 2: dict(color="tab:purple", ls="-.")}
    fig, axes = _figure(1, 2)
    ax_a, ax_m = axes[0]
    target = float(annealed_mass(model, n_ref))
    ax_m.plot(n, annealed_mass(model, n), color="tab:red", label="unscaled (alpha = 1)")
    for i, (label, a) in enumerate(alphas.items()):
        ax_a.plot(n, a, label=label, **styles[i])
        ax_m.plot(n, annealed_mass(model, n, a), label=label, **styles[i])
    ax_a.plot(n, alpha_law("qwen-logn", n, n_ref=n_ref), color="0.5", ls=":", label="Qwen LogN (slope 1 / ln n_ref)")
    ax_m.axhline(target, color="0.3", lw=0.8, ls=":", label=f"target {target:.3f} (mass at n_ref)")
    if mc_rows > 0:
        for v in mc_n:
            a_star = float(exact_alpha(model, [v], n_ref).alpha[0])
            a_t = float(alpha_law("log-linear", v, n_ref=n_ref, slope=beta_t))
            scales = [1.0, a_t] + ([a_star] if np.isfinite(a_star) else [])
            mean, sem = monte_carlo_mass(model, int(v), scales, rows=mc_rows, seed=seed)
            ax_m.errorbar([v] * len(scales), mean, yerr=2 * sem, fmt="s", ms=4, mfc="none",
                          color="0.2", capsize=2, label=f"Monte Carlo ({mc_rows} rows)" if v == mc_n[0] else None)
    for ax in (ax_a, ax_m):
        _log_n_axis(ax)
        if np.isfinite(corr.horizon_n) and corr.horizon_n <= n_max:
            ax.axvline(corr.horizon_n, color="tab:red", lw=1.2,
                       label=f"correction horizon n = {corr.horizon_n:.3g}")
    ax_a.set_ylabel("query scale alpha (multiplier)")
    ax_a.set_title("Query scale against n")
    ax_m.set_ylabel("top-k attention mass (fraction, annealed)")
    ax_m.set_ylim(0, 1.02)
    ax_m.set_title("Top-k mass under each law")
    ax_a.legend(fontsize=8)
    ax_m.legend(fontsize=8)
    fig.suptitle(title or f"Exact correction against fixed slopes ({_describe(model)}, n_ref = {n_ref})")
    return fig


def _describe(model: ScoreModel) -> str:
    if isinstance(model, Gaussian):
        return f"Gaussian D = {model.gap:g}, sigma = {model.sigma:g}, k = {model.top_k}"
    return f"{type(model).__name__}, k = {model.top_k}"


def horizon_figure(gaps: Sequence[float], sigmas: Sequence[float], *, top_k: int, n_ref: int,
                   n_max: float) -> Figure:
    """Correction horizon and slopes of the Gaussian model across the background spread sigma.

    Left: horizon ``n_max / n_ref`` (log scale; curves leave the top when the horizon is beyond
    1e12). Right: tangent slope ``1 / (D - sigma^2)`` and the least-squares slope over
    ``[n_ref, min(n_max, horizon)]``. Only ``sigma^2 < D`` is drawn (else no correction exists).
    """
    sigmas = np.asarray(sigmas, dtype=np.float64)
    fig, axes = _figure(1, 2)
    ax_h, ax_b = axes[0]
    for i, gap in enumerate(gaps):
        ok = sigmas**2 < 0.99 * gap  # at sigma^2 = D the slope diverges
        s = sigmas[ok]
        models = [Gaussian(gap=gap, sigma=v, top_k=top_k) for v in s]
        ratio = np.array([horizon_n(m, n_ref) / n_ref for m in models])
        colour = f"C{i}"
        ax_h.plot(s, np.minimum(ratio, 1e13), color=colour, label=f"D = {gap:g}")
        slopes = [_laws(m, n_ref, n_max) for m in models]
        ax_b.plot(s, [v["beta_t"] for v in slopes], color=colour, ls="--", label=f"D = {gap:g} tangent")
        ax_b.plot(s, [np.nan if v["beta_ls"] is None else v["beta_ls"] for v in slopes], color=colour,
                  label=f"D = {gap:g} least squares")
    ax_h.set_yscale("log")
    ax_h.set_ylim(1, 1e12)
    ax_h.axhline(n_max / n_ref, color="0.4", ls=":", label=f"n = {_tokens(n_max)} (n_max)")
    ax_h.set_xlabel("background spread sigma (logit units)")
    ax_h.set_ylabel("horizon n / n_ref (log scale)")
    ax_h.set_title("Longest length the exact correction can restore")
    ax_h.grid(True, alpha=0.3)
    ax_h.legend(fontsize=8)
    ax_b.set_xlabel("background spread sigma (logit units)")
    ax_b.set_ylabel("slope beta (alpha per e-fold of n)")
    ax_b.set_title(f"Fixed slopes (least squares over [n_ref, {_tokens(n_max)}])")
    ax_b.set_yscale("log")
    ax_b.grid(True, which="both", alpha=0.3)
    ax_b.legend(fontsize=7, ncol=2)
    fig.suptitle(f"Correction horizon, Gaussian background (top-{top_k}, n_ref = {n_ref})")
    return fig


# -- measurement -----------------------------------------------------------------------------------
def _meta_value(text: str):
    """Calibration stores run parameters JSON-encoded; older or hand-made files hold plain strings."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def load_stats(path: str | os.PathLike, *, n_ref: int | None = None, top_k: int | None = None):
    """``(stats, meta, n_ref, top_k)`` from a statistics file; missing settings come from its metadata.

    ``n_ref`` must be given or stored (``meta["n_ref"]``); ``top_k`` falls back to the stored value,
    then to 4 (calibration's default). Raises ``UserError`` (one line) when the file cannot be read
    or ``n_ref`` is neither given nor stored.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"statistics file {str(path)!r} does not exist; create it with "
                        "`sharpdraft calibrate --stats FILE`")
    try:
        stats, raw = RowStats.load(path)
    except ValueError as err:
        raise UserError(str(err)) from None
    meta = {key: _meta_value(text) for key, text in raw.items()}

    def setting(value, key, option, default=None):
        if value is not None:
            return int(value)
        stored = meta.get(key, default)
        if stored is None:
            raise UserError(f"{path.name} does not store {key}; pass {option}")
        try:
            return int(stored)
        except (TypeError, ValueError):
            raise UserError(f"{path.name} stores {key} = {stored!r}, not an integer; pass {option}") from None

    return stats, meta, setting(n_ref, "n_ref", "--n-ref"), setting(top_k, "top_k", "--top-k", DEFAULT_TOP_K)


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
    _mark_n_ref(ax, n_ref)


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
    fig, axes = _figure(1, 2)
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
        _log_n_axis(ax)
        ax.legend(fontsize=8)
    fig.suptitle(f"Measured dilution against the i.i.d. law ({title}, top-{top_k}, n_ref = {n_ref})")
    return fig


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
    fig, axes = _figure(1, 1, width=7.5, height=4.8)
    ax = axes[0, 0]
    for est in ESTIMATORS:
        r = fit.result(est)
        label, colour = _EST_STYLE[est]
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
    _mark_n_ref(ax, n_ref)
    ax.axvline(n_meas, color="0.6", ls="--", lw=0.8, label=f"last measured bucket (n ~ {n_meas:.0f})")
    _log_n_axis(ax)
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
    fig, axes = _figure(1, 3, width=3.0 + 0.25 * heads, height=max(3.2, 1.6 + 0.16 * layers))
    for ax, (est, grid) in zip(axes[0], grids.items()):
        im = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=vmin, vmax=vmax, origin="upper",
                       interpolation="nearest")
        filled = fit.result(est).diagnostics.get("groups_filled")
        label, _ = _EST_STYLE[est]
        ax.set_title(label + (f"\n({filled:.0f} cells = global value)" if filled else ""), fontsize=10)
        ax.set_xlabel("query head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(0, heads, max(1, heads // 10)))
        ax.set_yticks(range(0, layers, max(1, layers // 15)))
    fig.colorbar(im, ax=axes[0].tolist(), label="slope beta (per e-fold of n)", shrink=0.9)
    fig.suptitle(f"Per-head slopes ({title}; colour clipped to the 2-98% range)")
    return fig


def estimator_figure(fit_layer: SlopeFit, fit_head: SlopeFit | None = None, *, fit_global: SlopeFit | None = None,
                     title: str = "measured") -> Figure:
    """Estimator agreement: per-layer slopes of E1, E2, E3 (left) and per-head E2, E3 against E1 (right).

    Dashed lines and bands on the left are the global slopes and 95% bootstrap intervals, from
    ``fit_global`` when given (the per-layer fit may have been run without bootstrap).
    """
    fig, axes = _figure(1, 2 if fit_head is not None else 1)
    ax = axes[0, 0]
    per_layer = {est: np.atleast_1d(np.asarray(fit_layer.slopes[est], dtype=np.float64)) for est in ESTIMATORS}
    lo, hi = _robust_limits(np.concatenate(list(per_layer.values())))
    off = 0
    for est, slopes in per_layer.items():
        label, colour = _EST_STYLE[est]
        layer = np.arange(slopes.size)
        ax.plot(layer, np.clip(slopes, lo, hi), "o-", ms=3, color=colour, label=label)
        for mark, mask, edge in (("^", slopes > hi, hi), ("v", slopes < lo, lo)):
            ax.plot(layer[mask], np.full(mask.sum(), edge), mark, ms=8, color=colour)
            off += int(mask.sum())
        r = (fit_global or fit_layer).result(est)
        if r.ci_low is not None:
            ax.axhspan(r.ci_low, r.ci_high, color=colour, alpha=0.12, lw=0)
        if r.slope is not None:
            ax.axhline(r.slope, color=colour, lw=0.8, ls="--")
    ax.set_ylim(lo, hi)
    ax.set_xlabel("layer")
    ax.set_ylabel("slope beta (alpha per e-fold of n)")
    ax.set_title("Per-layer slopes (dashed: global, band: 95% CI)"
                 + (f"\n{off} off-scale values drawn at the edge as triangles" if off else ""))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if fit_head is not None:
        ax = axes[0, 1]
        e1 = np.asarray(fit_head.slopes["mass-matching"], dtype=np.float64).ravel()
        for est in ESTIMATORS[1:]:
            label, colour = _EST_STYLE[est]
            other = np.asarray(fit_head.slopes[est], dtype=np.float64).ravel()
            ok = np.isfinite(e1) & np.isfinite(other)
            corr = np.corrcoef(e1[ok], other[ok])[0, 1] if ok.sum() > 2 else np.nan
            ax.scatter(e1, other, s=8, color=colour, alpha=0.6, label=f"{label} (r = {corr:.2f})")
        both = np.concatenate([e1, *[np.asarray(fit_head.slopes[e], dtype=np.float64).ravel() for e in ESTIMATORS[1:]]])
        both = both[np.isfinite(both)]
        if both.size:
            lo, hi = np.percentile(both, [1, 99])
            pad = 0.05 * (hi - lo + 1e-9)
            ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="0.4", ls=":", label="equal slopes")
            ax.set_xlim(lo - pad, hi + pad)
            ax.set_ylim(lo - pad, hi + pad)
        ax.set_xlabel("E1 mass-matching slope (per head)")
        ax.set_ylabel("E2 / E3 slope (per head)")
        ax.set_title("Per-head agreement with E1")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Slope estimators side by side ({title})")
    return fig


def _robust_limits(values: np.ndarray) -> tuple[float, float]:
    """Axis limits for the bulk of ``values``: the data range, cut at 3 half-widths beyond the 5-95% range.

    One wild estimate (a head where an estimator breaks down) must not flatten all the others.
    """
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return 0.0, 1.0
    q_lo, q_hi = np.percentile(finite, [5, 95])
    pad = 0.5 * (q_hi - q_lo) + 1e-3
    lo, hi = max(finite.min(), q_lo - 3 * pad), min(finite.max(), q_hi + 3 * pad)
    margin = 0.05 * (hi - lo) + 1e-3
    return float(lo - margin), float(hi + margin)


@dataclass(frozen=True)
class LayerDiagnostics:
    """Per-layer fit diagnostics from ``fit_slopes`` run on each layer's rows alone."""

    layer: np.ndarray  # (layers,) layer index
    slopes: dict  # estimator -> (layers,) slope (NaN where undefined)
    gamma: np.ndarray  # dilution exponent: 1 under i.i.d. background (A2)
    g_prime: np.ndarray  # zbar_T(1) - zbar_B(1) on reference rows
    r2: np.ndarray  # E1: R^2 of the log-linear law through the matched alphas
    unreachable: np.ndarray  # E1: buckets whose reference mass is out of the alpha grid's reach
    tilted_mean_error: np.ndarray  # E3: observed tilted background mean minus mu + sigma^2 (logit units)
    log_sum_error: np.ndarray  # E3: |ln S_B(1) - annealed Gaussian| (nats)
    sigma2: np.ndarray  # background variance on reference rows


def layer_diagnostics(stats: RowStats, *, n_ref: int, top_k: int) -> LayerDiagnostics:
    """Run the three estimators on each layer's rows (no bootstrap) and collect their diagnostics."""
    layers = np.unique(stats.layer)
    fits = [fit_slopes(stats.select(stats.layer == layer), n_ref=n_ref, top_k=top_k, bootstrap=0)
            for layer in layers]

    def diag(est, key):
        return np.array([np.nan if (v := f.result(est).diagnostics.get(key)) is None else v for f in fits])

    return LayerDiagnostics(
        layer=layers,
        slopes={est: np.array([np.nan if f.result(est).slope is None else f.result(est).slope for f in fits])
                for est in ESTIMATORS},
        gamma=diag("closed-form", "gamma"), g_prime=diag("closed-form", "g_prime"),
        r2=diag("mass-matching", "r2"), unreachable=diag("mass-matching", "unreachable_buckets"),
        tilted_mean_error=diag("gaussian", "tilted_mean_error"), log_sum_error=diag("gaussian", "log_sum_error"),
        sigma2=diag("gaussian", "sigma2"))


def assumption_figure(stats: RowStats, diag: LayerDiagnostics, *, n_ref: int, top_k: int,
                      title: str = "measured") -> Figure:
    """Where the score model's assumptions fail, per layer and along n.

    (a) A2: dilution exponent gamma per layer (1 for an i.i.d. background).
    (b) A1: gap between the top set's tilted mean and the background mean, against n, relative to
        its value at n_ref (A1 and a stationary background keep it at 0).
    (c) Gaussian background: tilted-mean error (logit units) and log-sum error (nats) per layer.
    (d) E1: R^2 of the log-linear law and buckets out of the alpha grid's reach, per layer.
    """
    fig, axes = _figure(2, 2)
    ax = axes[0, 0]
    ax.bar(diag.layer, diag.gamma, color="tab:orange")
    ax.axhline(1.0, color="k", ls="--", label="i.i.d. background (gamma = 1)")
    ax.set_xlabel("layer")
    ax.set_ylabel("dilution exponent gamma")
    ax.set_title("(a) A2: does the background grow like n?")
    ax.legend(fontsize=8)

    ax = axes[0, 1]
    zbar_t, _ = stats.tilted_means(top_k)
    mu_b, _ = stats.background_moments(top_k)
    gap = zbar_t - mu_b
    n, mean_gap = by_length(stats, gap)
    _, layer_gap = by_length(stats, gap, stats.layer)
    for row in layer_gap:
        ax.plot(n, row - np.interp(np.log(n_ref), np.log(n), row), color="tab:blue", lw=0.5, alpha=0.3)
    ax.plot(n, mean_gap - np.interp(np.log(n_ref), np.log(n), mean_gap), "o-", color="tab:blue", ms=3, lw=2,
            label="mean over layers and heads")
    ax.axhline(0.0, color="k", ls="--", label="A1 + stationary background")
    _mark_n_ref(ax, n_ref)
    _log_n_axis(ax)
    ax.set_ylabel("gap change zbar_T - mean_B vs n_ref (logits)")
    ax.set_title("(b) A1: does the top set stay put as n grows?")
    ax.legend(fontsize=8)

    ax = axes[1, 0]
    ax.plot(diag.layer, diag.log_sum_error, "o-", ms=3, color="tab:green", label="|ln S_B - Gaussian annealed| (nats)")
    ax.plot(diag.layer, diag.tilted_mean_error, "s--", ms=3, color="tab:olive",
            label="tilted mean - (mu + sigma^2) (logits)")
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_yscale("symlog", linthresh=1.0)  # errors from 0.01 to far beyond 1 on one axis
    ax.set_xlabel("layer")
    ax.set_ylabel("error (nats / logit units, symlog)")
    ax.set_title("(c) Gaussian background on reference rows")
    ax.legend(fontsize=8)

    ax = axes[1, 1]
    ax.bar(diag.layer, diag.r2, color="tab:blue", label="E1 R^2 of 1 + beta ln(n / n_ref)")
    ax.set_ylim(min(0.0, np.nanmin(diag.r2) if np.isfinite(diag.r2).any() else 0.0), 1.05)
    ax.set_xlabel("layer")
    ax.set_ylabel("R^2 (uncentred, through alpha = 1)")
    ax.set_title("(d) Is the matched alpha log-linear in n?")
    if np.nansum(diag.unreachable) > 0:
        bad = diag.layer[diag.unreachable > 0]
        ax.plot(bad, np.full(bad.size, 1.02), "v", color="tab:red", label="buckets out of the alpha grid's reach")
    ax.legend(fontsize=8, loc="lower right")
    for a in axes.ravel():
        a.grid(True, alpha=0.3)
    fig.suptitle(f"Where the score model's assumptions fail ({title}, top-{top_k}, n_ref = {n_ref})")
    return fig


def _title(path: str | os.PathLike, meta: dict) -> str:
    """Figure title for a statistics file: its name and, when stored, the drafter and corpus."""
    parts = [str(meta[k]) for k in ("drafter", "corpus") if meta.get(k)]
    return Path(path).stem + (f" ({', '.join(parts)})" if parts else "")


# -- tables for the notebooks ----------------------------------------------------------------------
def describe_stats(stats: RowStats, meta: dict, *, n_ref: int, top_k: int) -> str:
    """One paragraph: what the statistics file holds and the settings used to read it."""
    stored = ", ".join(f"{k} = {meta[k]}" for k in ("drafter", "drafter_path", "corpus", "max_length", "dtype")
                       if k in meta)
    return (f"{stats.rows} rows: {np.unique(stats.layer).size} layers x {np.unique(stats.head).size} heads, "
            f"{np.unique(stats.seq).size} sequences, {np.unique(stats.n).size} sampled lengths "
            f"n = {int(stats.n.min())}..{int(stats.n.max())}; k_max = {stats.k_max}, alpha grid "
            f"{stats.alpha_grid.min():g}..{stats.alpha_grid.max():g} ({stats.alpha_grid.size} values)\n"
            f"run: {stored or 'no metadata'}\nread with n_ref = {n_ref}, top_k = {top_k}")


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


def format_results(fit: SlopeFit) -> str:
    """The three estimators' global slopes, intervals, notes and diagnostics; flags disagreement."""
    lines = [f"reference mass M_ref = {fit.mass_ref:.4f}"]
    for r in fit.results:
        ci = f"[{r.ci_low:.4f}, {r.ci_high:.4f}]" if r.ci_low is not None else "(no interval)"
        slope = f"{r.slope:.4f}" if r.slope is not None else "undefined"
        diag = ", ".join(f"{k} {v:.4g}" for k, v in r.diagnostics.items() if v is not None)
        lines.append(f"{_EST_STYLE[r.estimator][0]:<17} beta = {slope} {ci}" + (f"  note: {r.note}" if r.note else ""))
        lines.append(f"{'':<17} {diag}")
    bounded = [r for r in fit.results if r.ci_low is not None]
    for i, a in enumerate(bounded):
        for b in bounded[i + 1:]:
            if a.ci_high < b.ci_low or b.ci_high < a.ci_low:
                lines.append(f"DISAGREE: {a.estimator} and {b.estimator} have disjoint 95% intervals")
    return "\n".join(lines)


def format_failures(diag: LayerDiagnostics) -> str:
    """Layers where an assumption behind the estimators visibly fails, one line per check."""
    checks = (  # (what, mask): thresholds are loose on purpose, to point at the worst layers
        ("A2 i.i.d. background: |gamma - 1| > 0.25", np.abs(diag.gamma - 1) > 0.25),
        ("A3 / Gaussian: log-sum error > 0.5 nats", diag.log_sum_error > 0.5),
        ("Gaussian tilt: |tilted mean - (mu + sigma^2)| > 0.5 logits", np.abs(diag.tilted_mean_error) > 0.5),
        ("E1: R^2 of the log-linear law < 0.9", diag.r2 < 0.9),
        ("E1: reference mass out of the alpha grid's reach", diag.unreachable > 0),
        ("E3: tbar - mu - sigma^2 <= 0 (slope undefined)", ~np.isfinite(diag.slopes["gaussian"])),
    )
    lines = []
    for what, mask in checks:
        bad = diag.layer[np.asarray(mask, dtype=bool)]
        lines.append(f"{what}: " + (f"{bad.size} of {diag.layer.size} layers {bad.tolist()}" if bad.size else "none"))
    return "\n".join(lines)


# -- the standard set ------------------------------------------------------------------------------
def write_standard_figures(stats_path: str | os.PathLike, out: str | os.PathLike, *, n_ref: int | None = None,
                           top_k: int | None = None, bootstrap: int = 200, seed: int = 0) -> list[Path]:
    """Write ``STANDARD_FIGURES`` (dilution curves, alpha versus n, slope heatmap) for one file."""
    stats, meta, n_ref, top_k = load_stats(stats_path, n_ref=n_ref, top_k=top_k)
    if not 1 <= top_k <= stats.k_max:
        raise UserError(f"--top-k {top_k} must be between 1 and {stats.k_max} (the k_max of {Path(stats_path).name})")
    title = _title(stats_path, meta)
    try:
        fit = fit_slopes(stats, n_ref=n_ref, top_k=top_k, granularity="head", bootstrap=bootstrap, seed=seed)
    except ValueError as err:
        raise UserError(f"--n-ref {n_ref}: {err}") from None
    out = Path(out)
    figures = (measured_dilution_figure(stats, fit, n_ref=n_ref, top_k=top_k, title=title),
               alpha_figure(fit, n_ref=n_ref, title=title),
               slope_heatmap_figure(fit, title=title))
    return [save_figure(fig, out / name) for fig, name in zip(figures, STANDARD_FIGURES)]
