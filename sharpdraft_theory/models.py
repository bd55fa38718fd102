"""Score-distribution models for one attention row (theory.md section 2).

A model plants a top set of ``top_k`` logits ``t`` (assumption A1, independent of n) above an
i.i.d. background with law F (A2); the background sum is replaced by its mean (A3, "annealed"):
``S_B(a) ~= (n - k) exp(K(a))`` with ``K(a) = ln E[exp(a Z)]`` the cumulant generating function.
Under A1-A3 the top-k log-odds split into an n-free part and the dilution term::

    l_k(n, a) = g(a) - ln(n - k),      g(a) = LSE(a t) - K(a)

Only the gap between top and background matters (softmax is shift invariant), so the models put
the background location at 0 and the top logits at the gap ``D``.

Each model exposes ``g``, ``g_prime``, ``log_mgf`` (K), ``log_mgf_prime`` (K', the exponentially
tilted background mean), ``peak_alpha`` (where g stops increasing) and ``sample_background`` for
quenched Monte Carlo.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import brentq
from scipy.special import logsumexp

__all__ = ["ScoreModel", "TwoLevel", "Gaussian", "Empirical"]


class ScoreModel:
    """Shared algebra of the models; subclasses provide ``top_logits`` and the background K."""

    top_k: int

    @property
    def top_logits(self) -> np.ndarray:
        raise NotImplementedError

    def log_mgf(self, alpha):
        """``K(a) = ln E[exp(a Z)]`` of the background law."""
        raise NotImplementedError

    def log_mgf_prime(self, alpha):
        """``K'(a)``: mean of the background tilted by ``exp(a z)``."""
        raise NotImplementedError

    def sample_background(self, rng: np.random.Generator, size) -> np.ndarray:
        raise NotImplementedError

    def log_top(self, alpha):
        """``ln S_T(a) = LSE(a t)``."""
        a = np.asarray(alpha, dtype=np.float64)
        return logsumexp(a[..., None] * self.top_logits, axis=-1)

    def top_mean(self, alpha):
        """Tilted mean of the top logits, ``zbar_T(a)``."""
        a = np.asarray(alpha, dtype=np.float64)[..., None]
        w = np.exp(a * self.top_logits - logsumexp(a * self.top_logits, axis=-1, keepdims=True))
        return np.sum(w * self.top_logits, axis=-1)

    def g(self, alpha):
        """n-free part of the top-k log-odds: ``g(a) = LSE(a t) - K(a)``."""
        return self.log_top(alpha) - self.log_mgf(alpha)

    def g_prime(self, alpha):
        """``g'(a) = zbar_T(a) - K'(a)``."""
        return self.top_mean(alpha) - self.log_mgf_prime(alpha)

    def peak_alpha(self) -> float:
        """Smallest ``a >= 1`` where ``g'`` reaches 0 (``inf`` when g keeps increasing).

        Past it no query scale raises the top-k mass further: this defines the correction horizon.
        """
        if self.g_prime(1.0) <= 0:
            return 1.0
        hi = 2.0
        while self.g_prime(hi) > 0:
            hi *= 2.0
            if hi > 1e6:
                return float("inf")
        return float(brentq(self.g_prime, hi / 2.0 if hi > 2.0 else 1.0, hi, xtol=1e-13))


def _check_positive(name: str, value: float) -> float:
    value = float(value)
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return value


def _check_top_k(top_k: int) -> int:
    if int(top_k) != top_k or top_k < 1:
        raise ValueError(f"top_k must be an integer >= 1, got {top_k}")
    return int(top_k)


@dataclass(frozen=True)
class TwoLevel(ScoreModel):
    """``top_k`` logits at ``gap``, every background logit at 0 (F = point mass).

    ``g(a) = ln k + a D``, so the exact correction is linear in ``ln r``.
    """

    gap: float
    top_k: int

    def __post_init__(self):
        _check_positive("gap", self.gap)
        _check_top_k(self.top_k)

    @property
    def top_logits(self) -> np.ndarray:
        return np.full(self.top_k, float(self.gap))

    def log_mgf(self, alpha):
        return np.zeros_like(np.asarray(alpha, dtype=np.float64))

    def log_mgf_prime(self, alpha):
        return np.zeros_like(np.asarray(alpha, dtype=np.float64))

    def peak_alpha(self) -> float:
        return float("inf")

    def sample_background(self, rng, size):
        return np.zeros(size)


@dataclass(frozen=True)
class Gaussian(ScoreModel):
    """``top_k`` logits at ``gap``, background i.i.d. ``N(0, sigma^2)``.

    ``K(a) = a^2 s^2 / 2``, ``g(a) = ln k + a D - a^2 s^2 / 2``, peaked at ``a = D / s^2``.
    """

    gap: float
    sigma: float
    top_k: int

    def __post_init__(self):
        _check_positive("gap", self.gap)
        _check_positive("sigma", self.sigma)
        _check_top_k(self.top_k)

    @property
    def top_logits(self) -> np.ndarray:
        return np.full(self.top_k, float(self.gap))

    def log_mgf(self, alpha):
        a = np.asarray(alpha, dtype=np.float64)
        return 0.5 * a * a * self.sigma**2

    def log_mgf_prime(self, alpha):
        return np.asarray(alpha, dtype=np.float64) * self.sigma**2

    def peak_alpha(self) -> float:
        return self.gap / self.sigma**2

    def sample_background(self, rng, size):
        return rng.normal(0.0, self.sigma, size=size)


@dataclass(frozen=True, eq=False)
class Empirical(ScoreModel):
    """Top logits and background given by samples; ``K(a) = LSE(a z_B) - ln |B|``.

    This is the assumption-light model used on real logits: it keeps A1 and A3 but takes the
    background law from data instead of a parametric family.
    """

    top: np.ndarray
    background: np.ndarray
    top_k: int = field(init=False)

    def __post_init__(self):
        top = np.sort(np.asarray(self.top, dtype=np.float64).ravel())[::-1]
        bg = np.asarray(self.background, dtype=np.float64).ravel()
        if top.size < 1 or bg.size < 1:
            raise ValueError("Empirical needs at least one top logit and one background logit")
        if not (np.all(np.isfinite(top)) and np.all(np.isfinite(bg))):
            raise ValueError("Empirical logits must be finite (found NaN or inf)")
        object.__setattr__(self, "top", top)
        object.__setattr__(self, "background", bg)
        object.__setattr__(self, "top_k", int(top.size))

    @property
    def top_logits(self) -> np.ndarray:
        return self.top

    def log_mgf(self, alpha):
        a = np.asarray(alpha, dtype=np.float64)[..., None]
        return logsumexp(a * self.background, axis=-1) - np.log(self.background.size)

    def log_mgf_prime(self, alpha):
        a = np.asarray(alpha, dtype=np.float64)[..., None]
        w = np.exp(a * self.background - logsumexp(a * self.background, axis=-1, keepdims=True))
        return np.sum(w * self.background, axis=-1)

    def sample_background(self, rng, size):
        return rng.choice(self.background, size=size, replace=True)
