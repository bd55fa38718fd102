"""Dilution or distance drift: the measured far profile against its continuation from the seen distances.

* ``drift_figure``  three panels from ``sharpdraft_theory.drift``: (1) the background's mean weight
  ``P(1, d)`` per distance, measured and continued from ``d <= W``; (2) the mean top-k mass at the
  longest length against alpha, with far keys as seen (dilution alone) and as measured, beside the
  reference mass; (3) per head, the mass dilution alone removes against the far keys' level over
  their continuation, with the verdict's thresholds.

Reading it: where the measured profile follows the continuation past ``W`` the far keys are scored
as the seen ones and a query scale undoes the dilution (panel 2: the two curves cross ``M_ref``
together); where it stands above, the unseen distances draw mass the seen profile does not
predict, which a window of ``W`` keys or a position fix removes.
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from sharpdraft_theory.distance import DistanceFit
from sharpdraft_theory.drift import DILUTION_THRESHOLD, LEVEL_THRESHOLD, DriftParts, Verdict, continued_profiles

from .style import new_figure, token_label

__all__ = ["far_profile", "drift_figure"]


def far_profile(fit: DistanceFit, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per distance bin with keys: (geometric centre, measured ln P(1, d), continued ln P(1, d)), over all heads.

    Measured: summed weights over summed keys. Continued: each head's continuation at the bin
    (its mean over the bin's distances), weighted by the head's measured keys there.
    """
    one = int(np.argmin(np.abs(fit.alpha - 1.0)))
    weight = fit.seq_weight[..., one].sum(axis=0)  # (H, B)
    keys = fit.seq_keys.sum(axis=0)  # (H, B)
    lo, hi = fit.edges[:-1], fit.edges[1:]
    held = keys.sum(axis=0) > 0
    continued = continued_profiles(fit, window)
    cont = np.stack([np.exp(p.log_sum(lo, hi)[:, one]) / (hi - lo) for p in continued])  # (H, B)
    with np.errstate(divide="ignore", invalid="ignore"):
        measured = np.log(weight.sum(axis=0) / keys.sum(axis=0))
        cont_mean = np.log(np.sum(keys * cont, axis=0) / keys.sum(axis=0))
    centre = np.sqrt(lo * (hi - 1.0))
    return centre[held], measured[held], cont_mean[held]


def drift_figure(fit: DistanceFit, parts: tuple[DriftParts, DriftParts], verdict: Verdict, *,
                 title: str = "measured") -> Figure:
    """The three panels of the module docstring; ``parts`` is the global and per-head ``decompose``."""
    g, h = parts
    fig, axes = new_figure(1, 3, width=5.4, height=4.6)
    ax = axes[0, 0]
    d, measured, cont = far_profile(fit, g.window)
    ax.plot(d, measured, "o-", ms=3, lw=2, color="tab:red", label="measured")
    ax.plot(d, cont, "--", lw=2, color="tab:blue", label=f"continued from d <= {g.window:,}")
    ax.axvline(g.window, color="0.4", ls=":", lw=1.0, label=f"seen window W = {g.window:,}")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(lambda x, _pos=None: token_label(x))
    ax.grid(True, which="major", alpha=0.3)
    ax.set_xlabel("query-key distance d (tokens, log scale)")
    ax.set_ylabel("ln P(1, d): mean background weight vs row max (nats)")
    ax.set_title("Far profile, all heads")
    ax.legend(fontsize=8)

    ax = axes[0, 1]
    ax.plot(g.alpha, g.mass_continued, "--", lw=2, color="tab:blue", label="far keys as seen (dilution alone)")
    if g.tested:
        ax.plot(g.alpha, g.mass_measured, "o-", ms=3, lw=2, color="tab:red", label="far keys as measured")
    ax.axhline(float(g.mass_ref), color="0.3", lw=1.0, label=f"M_ref at n_ref = {fit.n_ref:,}")
    ax.axvline(1.0, color="0.6", ls=":", lw=1.0)
    ax.set_xlabel("query scale alpha")
    ax.set_ylabel(f"mean top-{fit.top_k} mass at n = {g.n:,}")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.set_title("What a query scale does at the longest length")
    ax.legend(fontsize=8)

    ax = axes[0, 2]
    dil, lev = h.value("dilution").ravel(), h.value("level").ravel()
    if g.tested:
        drifted = (np.where(np.isfinite(h.low("level")), h.low("level"), h.value("level")) > LEVEL_THRESHOLD).ravel()
        ax.scatter(dil[~drifted], lev[~drifted], s=14, color="tab:blue", alpha=0.7, label="head")
        ax.scatter(dil[drifted], lev[drifted], s=14, color="tab:red", alpha=0.7, label="head, drift flagged")
        yerr = None
        if np.isfinite(g.low("level")):
            yerr = [[float(g.value("level") - g.low("level"))], [float(g.high("level") - g.value("level"))]]
        xerr = None
        if np.isfinite(g.low("dilution")):
            xerr = [[float(g.value("dilution") - g.low("dilution"))], [float(g.high("dilution") - g.value("dilution"))]]
        ax.errorbar([float(g.value("dilution"))], [float(g.value("level"))], xerr=xerr, yerr=yerr, fmt="*", ms=12,
                    color="k", label="all heads (95% over sequences)")
        ax.axhline(LEVEL_THRESHOLD, color="tab:red", ls=":", lw=1.0, label="drift threshold ln 2")
        ax.axhline(0.0, color="0.6", lw=0.8)
    else:
        ax.text(0.5, 0.5, f"no distance past W = {g.window:,} measured:\nonly dilution is judged",
                transform=ax.transAxes, ha="center", va="center")
    ax.axvline(DILUTION_THRESHOLD, color="tab:blue", ls=":", lw=1.0, label=f"dilution threshold {DILUTION_THRESHOLD}")
    ax.set_xlabel("mass dilution alone removes, M_ref - M_c(1; n)")
    ax.set_ylabel("far-key level over continuation, lambda(1) (nats)")
    ax.grid(True, alpha=0.3)
    ax.set_title(f"Per head: verdict {verdict.verdict}")
    ax.legend(fontsize=7)
    fig.suptitle(f"Dilution or distance drift past the seen distances ({title})")
    return fig
