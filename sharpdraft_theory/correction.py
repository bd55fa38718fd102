"""Exact top-k mass correction, its horizon, the annealed regime, and the fixed-slope law.

Theory (theory.md sections 3-4). With ``r = (n - k) / (n_ref - k)`` the annealed log-odds are
``l_k(n, a) = g(a) - ln(n - k)``. The exact correction ``a*(n)`` keeps the top-k mass at its
reference value (``a = 1`` at ``n_ref``)::

    g(a*) = g(1) + ln r

``g`` increases on ``[0, a_peak]``, so the root is unique on that branch. Beyond
``ln r_max = g(a_peak) - g(1)`` no query scale restores the mass: that is the correction horizon.

Closed forms:

* two-level (gap D): ``a* = 1 + ln r / D``
* Gaussian (gap D, spread s): ``a* = (D - sqrt((D - s^2)^2 - 2 s^2 ln r)) / s^2``, computed in the
  cancellation-free form ``(2 D - s^2 + 2 ln r) / (D + sqrt(disc))``; horizon
  ``ln r_max = (D - s^2)^2 / (2 s^2)``; needs ``D > s^2``.

Linearising in ``ln r`` at ``r = 1`` gives the fixed slope ``beta = 1 / g'(1)``; for ``n >> k``,
``ln r ~= ln(n / n_ref)``, which is the deployed law ``alpha(n) = 1 + beta ln(n / n_ref)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq

from .models import Gaussian, ScoreModel, TwoLevel

__all__ = [
    "Correction",
    "log_ratio",
    "exact_alpha",
    "horizon_log_ratio",
    "horizon_n",
    "regime",
    "tangent_slope",
    "least_squares_slope",
]

@dataclass(frozen=True)
class Correction:
    """Exact correction for a set of lengths.

    ``alpha`` is NaN exactly where ``reachable`` is False (past the horizon, or below ``a = 0``
    for lengths so short that even ``a = 0`` leaves too much mass); ``horizon_n`` is the largest
    length the correction can restore (``inf`` when there is none).
    """

    n: np.ndarray  # lengths asked for
    alpha: np.ndarray  # a*(n); NaN where not reachable
    reachable: np.ndarray  # bool: a root exists on the increasing branch of g
    horizon_n: float  # first length past which no a restores the mass


def log_ratio(n, n_ref: int, top_k: int) -> np.ndarray:
    """``ln r = ln((n - k) / (n_ref - k))``, the log of the background growth."""
    n = np.asarray(n, dtype=np.float64)
    if n_ref <= top_k:
        raise ValueError(f"n_ref={n_ref} must exceed top_k={top_k}")
    if np.any(n <= top_k):
        raise ValueError(f"every n must exceed top_k={top_k}, got min n={n.min():g}")
    return np.log(n - top_k) - np.log(n_ref - top_k)


def horizon_log_ratio(model: ScoreModel) -> float:
    """Largest ``ln r`` the exact correction can restore: ``g(a_peak) - g(1)``."""
    if isinstance(model, Gaussian):
        d, s2 = model.gap, model.sigma**2
        return (d - s2) ** 2 / (2 * s2) if d > s2 else 0.0
    peak = model.peak_alpha()
    return float("inf") if np.isinf(peak) else float(model.g(peak) - model.g(1.0))


def horizon_n(model: ScoreModel, n_ref: int) -> float:
    """Length at the correction horizon: ``k + (n_ref - k) exp(ln r_max)``."""
    log_r_max = horizon_log_ratio(model)
    if np.isinf(log_r_max):
        return float("inf")
    with np.errstate(over="ignore"):
        return float(model.top_k + (n_ref - model.top_k) * np.exp(log_r_max))


def _numeric_alpha(model: ScoreModel, log_r: np.ndarray) -> np.ndarray:
    peak = model.peak_alpha()
    g1 = float(model.g(1.0))
    g0 = float(model.g(0.0))
    out = np.full(log_r.shape, np.nan)
    for idx, lr in np.ndenumerate(log_r):
        target = g1 + lr
        if target < g0:
            continue
        hi = 2.0 if np.isinf(peak) else peak
        if np.isinf(peak):
            while model.g(hi) < target:
                hi *= 2.0
        elif model.g(peak) < target:
            continue
        out[idx] = brentq(lambda a: model.g(a) - target, 0.0, hi, xtol=1e-14, rtol=1e-14)
    return out


def exact_alpha(model: ScoreModel, n, n_ref: int, method: str = "auto") -> Correction:
    """Exact top-k mass correction ``a*(n)`` under the annealed model.

    Parameters
    ----------
    model : ScoreModel
        Score distribution (``TwoLevel``, ``Gaussian`` use closed forms; others a root find).
    n : array_like of int
        Visible key counts.
    n_ref : int
        Reference length: ``a*(n_ref) = 1``.
    method : {"auto", "root"}
        ``auto`` uses the closed form where the model has one; ``root`` always root-finds
        (Brent on the increasing branch), which the tests use to check the closed forms.

    Notes
    -----
    Solves ``g(a) = g(1) + ln r`` on the increasing branch of ``g``.

    Examples
    --------
    >>> c = exact_alpha(TwoLevel(gap=5.0, top_k=4), [4 + 508 * 148.4131591025766], 512)
    >>> round(float(c.alpha[0]), 6)  # ln r = 5, a* = 1 + 5 / 5
    2.0
    """
    n = np.atleast_1d(np.asarray(n, dtype=np.float64))
    log_r = log_ratio(n, n_ref, model.top_k)
    if method not in ("auto", "root"):
        raise ValueError(f"method must be 'auto' or 'root', got {method!r}")
    if method == "root":
        alpha = _numeric_alpha(model, log_r)
    elif isinstance(model, TwoLevel):
        alpha = 1.0 + log_r / model.gap
        alpha = np.where(alpha >= 0, alpha, np.nan)
    elif isinstance(model, Gaussian):
        alpha = _gaussian_alpha(model.gap, model.sigma, log_r)
    else:
        alpha = _numeric_alpha(model, log_r)
    return Correction(n=n, alpha=alpha, reachable=np.isfinite(alpha), horizon_n=horizon_n(model, n_ref))


def _gaussian_alpha(gap, sigma, log_r):
    d, s2 = np.asarray(gap, dtype=np.float64), np.asarray(sigma, dtype=np.float64) ** 2
    disc = (d - s2) ** 2 - 2.0 * s2 * log_r
    with np.errstate(invalid="ignore", divide="ignore"):
        alpha = (2.0 * d - s2 + 2.0 * log_r) / (d + np.sqrt(disc))
    ok = (disc >= 0) & (d > s2) & (alpha >= 0)
    return np.where(ok, alpha, np.nan)


def regime(model: ScoreModel, n, alpha) -> np.ndarray:
    """Where the annealed sum A3 can be trusted, per (n, alpha).

    The background sum ``S_B`` of ``N = n - k`` terms ``w = exp(a Z)`` behaves like
    ``N_eff = N exp(2 K(a) - K(2 a))`` equally weighted terms. The labels follow the Gaussian
    random-energy-model thresholds, written through ``N_eff`` so they apply to any model:

    * ``annealed``: ``N_eff >= sqrt(N)`` (Gaussian: ``(a s)^2 <= ln N / 2``), sum concentrated;
    * ``frozen``: ``N_eff <= 1 / N`` (Gaussian: ``a s >= sqrt(2 ln N)``), a few terms dominate;
    * ``crossover`` in between: the annealed formulas drift from the quenched truth.
    """
    n = np.asarray(n, dtype=np.float64)
    a = np.asarray(alpha, dtype=np.float64)
    n, a = np.broadcast_arrays(n, a)
    log_n = np.log(n - model.top_k)
    log_neff = log_n + 2.0 * model.log_mgf(a) - model.log_mgf(2.0 * a)
    labels = np.where(log_neff >= 0.5 * log_n, "annealed", np.where(log_neff <= -log_n, "frozen", "crossover"))
    return np.where(np.isfinite(a), labels, "n/a")


def tangent_slope(model: ScoreModel) -> float:
    """Fixed slope from linearising ``a*`` at ``r = 1``: ``beta = 1 / g'(1)``.

    Examples
    --------
    >>> round(tangent_slope(Gaussian(gap=6.0, sigma=1.0, top_k=4)), 6)  # 1 / (D - s^2)
    0.2
    """
    slope = float(model.g_prime(1.0))
    if slope <= 0:
        raise ValueError(f"g'(1) = {slope:.4g} <= 0: the top set is not above the tilted background")
    return 1.0 / slope


def least_squares_slope(model: ScoreModel, n_ref: int, n_max: float, points: int = 64) -> float:
    """Slope of ``a*(n) - 1 = beta ln(n / n_ref)`` fitted through the origin over ``[n_ref, n_max]``.

    The deployed law uses ``ln(n / n_ref)``, so the fit is done in that variable. ``a*`` is convex
    in ``ln r`` for the Gaussian model, so this slope is larger than the tangent: it trades
    accuracy near ``n_ref`` for accuracy far out. Lengths past the horizon are left out.
    """
    if not n_max > n_ref:
        raise ValueError(f"n_max={n_max} must exceed n_ref={n_ref}")
    n = np.geomspace(n_ref, n_max, points)[1:]
    c = exact_alpha(model, n, n_ref)
    x = np.log(n / n_ref)[c.reachable]
    if x.size == 0:
        raise ValueError(f"no length in ({n_ref}, {n_max:g}] is inside the correction horizon")
    y = c.alpha[c.reachable] - 1.0
    return float(np.dot(x, y) / np.dot(x, x))
