"""Theory figures: the score models of docs/theory.md sections 2-4, evaluated and drawn.

* ``dilution_law_figure``   top-k mass against n for several gaps, spreads and k (annealed law)
* ``quenched_figure``       annealed formula against quenched Monte Carlo, regimes shaded
* ``correction_figure``     exact correction against the tangent and least-squares slopes
* ``horizon_figure``        the correction horizon and the slopes across the background spread

The math lives in ``sharpdraft_theory``; this module only evaluates it and draws. Slopes are per
e-fold of n.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from scipy.special import logit

from sharpdraft_theory import (Gaussian, ScoreModel, alpha_law, annealed_mass, exact_alpha, horizon_n,
                               least_squares_slope, monte_carlo_mass, regime, tangent_slope)

from .style import log_n_axis, mark_n_ref, new_figure, token_label

__all__ = ["dilution_law_figure", "quenched_figure", "correction_figure", "horizon_figure"]

_REGIME_COLOUR = {"annealed": "#e8f4e8", "crossover": "#fdf1d8", "frozen": "#f9dede"}


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
    fig, axes = new_figure(1, len(panels), width=4.6)
    for ax, (title, models) in zip(axes[0], panels.items()):
        for label, model in models.items():
            n = np.geomspace(model.top_k + 1, n_max, 200)
            ax.plot(n, annealed_mass(model, n), label=label)
        mark_n_ref(ax, n_ref)
        log_n_axis(ax)
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
    fig, axes = new_figure(1, len(models), width=4.6)
    for ax, (label, model) in zip(axes[0], models.items()):
        fine = np.geomspace(max(model.top_k + 2, n.min() / 1.5), n.max() * 1.5, 160)
        _shade_regimes(ax, model, fine, alpha)
        (line,) = ax.plot(fine, logit(annealed_mass(model, fine, alpha)), color="k", label="annealed formula")
        mc = np.array([monte_carlo_mass(model, int(v), alpha, rows=rows, seed=seed) for v in n])  # (len(n), 2)
        mean = np.clip(mc[:, 0], 1e-12, 1 - 1e-12)
        points = ax.errorbar(n, logit(mean), yerr=2 * mc[:, 1] / (mean * (1 - mean)), fmt="o", ms=4,
                             color="tab:red", capsize=2, label=f"Monte Carlo ({rows} rows)")
        log_n_axis(ax)
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
    fig, axes = new_figure(1, 2)
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
        log_n_axis(ax)
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
    fig, axes = new_figure(1, 2)
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
    ax_h.axhline(n_max / n_ref, color="0.4", ls=":", label=f"n = {token_label(n_max)} (n_max)")
    ax_h.set_xlabel("background spread sigma (logit units)")
    ax_h.set_ylabel("horizon n / n_ref (log scale)")
    ax_h.set_title("Longest length the exact correction can restore")
    ax_h.grid(True, alpha=0.3)
    ax_h.legend(fontsize=8)
    ax_b.set_xlabel("background spread sigma (logit units)")
    ax_b.set_ylabel("slope beta (alpha per e-fold of n)")
    ax_b.set_title(f"Fixed slopes (least squares over [n_ref, {token_label(n_max)}])")
    ax_b.set_yscale("log")
    ax_b.grid(True, which="both", alpha=0.3)
    ax_b.legend(fontsize=7, ncol=2)
    fig.suptitle(f"Correction horizon, Gaussian background (top-{top_k}, n_ref = {n_ref})")
    return fig
