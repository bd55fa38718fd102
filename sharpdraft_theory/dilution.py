"""Attention-mass dilution: the annealed law and quenched Monte Carlo (theory.md section 2).

Under A1-A3 the top-k log-odds fall by one unit per e-fold of background keys::

    l_k(n) = l_k(n_ref) - ln r,     r = (n - k) / (n_ref - k)
    M_k(n) = M0 / (M0 + (1 - M0) r),   M0 = M_k(n_ref)

``monte_carlo_mass`` draws whole rows (planted top set, i.i.d. background) and averages the exact
finite-n mass: the quenched quantity the annealed formulas approximate.
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit, logsumexp

from .correction import log_ratio
from .models import ScoreModel

__all__ = ["dilution_mass", "annealed_log_odds", "annealed_mass", "monte_carlo_mass"]


def dilution_mass(mass_ref, n, n_ref: int, top_k: int, gamma=1.0) -> np.ndarray:
    """Top-k mass at ``n`` predicted from the mass ``mass_ref`` at ``n_ref`` (no scaling).

    The log-odds fall by ``gamma ln r``: ``gamma = 1`` under an i.i.d. background (A2);
    theory.md section 5 measures ``gamma`` on real attention.

    Examples
    --------
    >>> round(float(dilution_mass(0.5, 4 + 2 * 508, 512, 4)), 6)  # r = 2 halves the odds
    0.333333
    """
    m0 = np.asarray(mass_ref, dtype=np.float64)
    if np.any((m0 <= 0) | (m0 >= 1)):
        raise ValueError(f"mass_ref must lie in (0, 1), got {mass_ref}")
    r_gamma = np.exp(np.asarray(gamma, dtype=np.float64) * log_ratio(n, n_ref, top_k))
    return m0 / (m0 + (1.0 - m0) * r_gamma)


def annealed_log_odds(model: ScoreModel, n, alpha=1.0) -> np.ndarray:
    """``l_k(n, a) = g(a) - ln(n - k)``."""
    n = np.asarray(n, dtype=np.float64)
    return model.g(alpha) - np.log(n - model.top_k)


def annealed_mass(model: ScoreModel, n, alpha=1.0) -> np.ndarray:
    """Top-k mass under the annealed sum (A3)."""
    return expit(annealed_log_odds(model, n, alpha))


def monte_carlo_mass(
    model: ScoreModel,
    n: int,
    alpha=1.0,
    *,
    rows: int = 256,
    seed: int = 0,
    chunk_elements: int = 1 << 22,
) -> tuple[np.ndarray, np.ndarray]:
    """Quenched Monte Carlo mean top-k mass and its standard error, for each ``alpha``.

    Each row draws ``n - k`` background logits from the model's law next to the planted top
    logits; every alpha uses the same rows (common random numbers), so differences between
    alphas are not noise. Memory stays below ``chunk_elements`` floats per chunk.

    Returns
    -------
    mean, sem : ndarray, shape of ``alpha``
    """
    n = int(n)
    if n <= model.top_k:
        raise ValueError(f"n={n} must exceed top_k={model.top_k}")
    a = np.atleast_1d(np.asarray(alpha, dtype=np.float64))
    rng = np.random.default_rng(seed)
    width = n - model.top_k
    per_chunk = max(1, chunk_elements // width)
    masses = []
    done = 0
    while done < rows:
        m = min(per_chunk, rows - done)
        bg = model.sample_background(rng, (m, width))  # (m, n - k)
        log_bg = logsumexp(a[:, None, None] * bg[None], axis=-1)  # (alphas, m)
        log_top = model.log_top(a)[:, None]  # (alphas, 1)
        masses.append(expit(log_top - log_bg))
        done += m
    mass = np.concatenate(masses, axis=1)  # (alphas, rows)
    mean = mass.mean(axis=1)
    sem = mass.std(axis=1, ddof=1) / np.sqrt(rows) if rows > 1 else np.zeros_like(mean)
    shape = np.shape(alpha)
    return mean.reshape(shape), sem.reshape(shape)
