"""Top-k attention mass, its log-odds and tilted means, for batches of attention rows.

One attention row is a query that sees ``n`` keys with logits ``z_1..z_n`` (the softmax scale
already applied). Scaling the query by ``alpha`` scales every logit by ``alpha``. With ``T`` the
``k`` largest logits and ``B`` the rest::

    S_T(a) = sum_{j in T} exp(a z_j)        S_B(a) = sum_{j in B} exp(a z_j)
    M_k(a) = S_T / (S_T + S_B)              l_k(a) = ln S_T - ln S_B

Everything is computed in float64 and in log space, so ``a`` up to ~10 with logits up to ~50 does
not overflow. Rows of different lengths share one array: a key whose logit is ``-inf`` is not
visible (it is masked out and does not count towards ``n``).
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit, logsumexp

__all__ = ["log_sum_exp_top", "topk_log_odds", "topk_mass", "tilted_mean", "n_visible"]


def _rows(logits) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    if z.ndim == 0:
        raise ValueError("logits must have at least one dimension (..., n)")
    return z


def n_visible(logits) -> np.ndarray:
    """Number of visible (finite) keys per row: shape ``logits.shape[:-1]``."""
    return np.isfinite(_rows(logits)).sum(axis=-1)


def _split_top(z: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    if not 1 <= k:
        raise ValueError(f"top_k must be >= 1, got {k}")
    n = z.shape[-1]
    if k >= n:
        raise ValueError(f"top_k={k} must be smaller than the number of keys {n}")
    part = np.partition(z, n - k, axis=-1)
    return part[..., n - k :], part[..., : n - k]


def log_sum_exp_top(logits, top_k: int, alpha=1.0) -> tuple[np.ndarray, np.ndarray]:
    """``(ln S_T(alpha), ln S_B(alpha))`` per row.

    Parameters
    ----------
    logits : array_like, shape (..., n)
        Attention logits; ``-inf`` marks a key that is not visible.
    top_k : int
        Size of the top set ``T``.
    alpha : float or array_like broadcastable to ``logits.shape[:-1]``
        Query scale.
    """
    z = _rows(logits)
    a = np.asarray(alpha, dtype=np.float64)[..., None]
    top, rest = _split_top(z, top_k)
    with np.errstate(invalid="ignore"):  # -inf * a for masked keys stays -inf for a > 0
        return logsumexp(a * top, axis=-1), logsumexp(np.where(np.isfinite(rest), a * rest, -np.inf), axis=-1)


def topk_log_odds(logits, top_k: int, alpha=1.0) -> np.ndarray:
    """Log-odds of the top-k mass, ``l_k(alpha) = ln S_T - ln S_B``, per row."""
    log_top, log_rest = log_sum_exp_top(logits, top_k, alpha)
    return log_top - log_rest


def topk_mass(logits, top_k: int, alpha=1.0) -> np.ndarray:
    """Softmax mass on the ``top_k`` largest logits after scaling the query by ``alpha``.

    Notes
    -----
    ``M_k(a) = logistic(l_k(a))`` with ``l_k(a) = LSE(a z_T) - LSE(a z_B)``. ``M_k`` is
    non-decreasing in ``a`` because ``d l_k / d a = zbar_T(a) - zbar_B(a) >= 0``, and
    ``M_k(0) = k / n``.

    Examples
    --------
    >>> import numpy as np
    >>> z = np.array([[4.0, 0.0, 0.0, 0.0]])
    >>> float(topk_mass(z, 1)[0].round(4))
    0.9479
    >>> float(topk_mass(z, 1, alpha=0.0)[0])
    0.25
    """
    return expit(topk_log_odds(logits, top_k, alpha))


def tilted_mean(values, alpha=1.0, axis: int = -1) -> np.ndarray:
    """Exponentially tilted mean ``sum z e^{a z} / sum e^{a z}`` along ``axis`` (``-inf`` ignored).

    Examples
    --------
    >>> float(tilted_mean([0.0, 0.0], alpha=3.0))
    0.0
    """
    z = np.moveaxis(_rows(values), axis, -1)
    a = np.asarray(alpha, dtype=np.float64)[..., None]
    finite = np.isfinite(z)
    az = np.where(finite, a * np.where(finite, z, 0.0), -np.inf)
    w = np.exp(az - logsumexp(az, axis=-1, keepdims=True))
    return np.sum(w * np.where(finite, z, 0.0), axis=-1)
