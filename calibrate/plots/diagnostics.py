"""Diagnostics: do the three estimators agree, and where do the score model's assumptions fail?

* ``estimator_figure``   per-layer slopes of E1, E2, E3 and their per-head agreement
* ``format_results``     the global slopes, intervals and diagnostics as text; flags disagreement
* ``layer_diagnostics``  the estimators run on each layer alone (``LayerDiagnostics``)
* ``assumption_figure``  where A1-A3 and the Gaussian background fail, per layer
* ``format_failures``    the layers where a check fails, as text
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure

from sharpdraft_theory.estimators import ESTIMATORS, SlopeFit, fit_slopes
from sharpdraft_theory.stats import RowStats

from .measured import by_length
from .style import ESTIMATOR_STYLE, log_n_axis, mark_n_ref, new_figure

__all__ = ["estimator_figure", "format_results", "LayerDiagnostics", "layer_diagnostics", "assumption_figure",
           "format_failures"]


def estimator_figure(fit_layer: SlopeFit, fit_head: SlopeFit | None = None, *, fit_global: SlopeFit | None = None,
                     title: str = "measured") -> Figure:
    """Estimator agreement: per-layer slopes of E1, E2, E3 (left) and per-head E2, E3 against E1 (right).

    Dashed lines and bands on the left are the global slopes and 95% bootstrap intervals, from
    ``fit_global`` when given (the per-layer fit may have been run without bootstrap).
    """
    fig, axes = new_figure(1, 2 if fit_head is not None else 1)
    ax = axes[0, 0]
    per_layer = {est: np.atleast_1d(np.asarray(fit_layer.slopes[est], dtype=np.float64)) for est in ESTIMATORS}
    lo, hi = _robust_limits(np.concatenate(list(per_layer.values())))
    off = 0
    for est, slopes in per_layer.items():
        label, colour = ESTIMATOR_STYLE[est]
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
            label, colour = ESTIMATOR_STYLE[est]
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


def format_results(fit: SlopeFit) -> str:
    """The three estimators' global slopes, intervals, notes and diagnostics; flags disagreement."""
    lines = [f"reference mass M_ref = {fit.mass_ref:.4f}"]
    for r in fit.results:
        ci = f"[{r.ci_low:.4f}, {r.ci_high:.4f}]" if r.ci_low is not None else "(no interval)"
        slope = f"{r.slope:.4f}" if r.slope is not None else "undefined"
        diag = ", ".join(f"{k} {v:.4g}" for k, v in r.diagnostics.items() if v is not None)
        lines.append(f"{ESTIMATOR_STYLE[r.estimator][0]:<17} beta = {slope} {ci}" + (f"  note: {r.note}" if r.note else ""))
        lines.append(f"{'':<17} {diag}")
    bounded = [r for r in fit.results if r.ci_low is not None]
    for i, a in enumerate(bounded):
        for b in bounded[i + 1:]:
            if a.ci_high < b.ci_low or b.ci_high < a.ci_low:
                lines.append(f"DISAGREE: {a.estimator} and {b.estimator} have disjoint 95% intervals")
    return "\n".join(lines)


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
    fig, axes = new_figure(2, 2)
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
    mark_n_ref(ax, n_ref)
    log_n_axis(ax)
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
