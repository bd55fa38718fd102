"""Query-scaling laws ``alpha(n)``: one registry entry per law, for numpy and torch alike.

=============  =========================================================  ======================
law            alpha(n)                                                   parameters
=============  =========================================================  ======================
log-linear     1 for n <= n_ref, else 1 + slope ln(n / n_ref) (SharpDraft)  n_ref, slope
qwen-logn      max(1, ln n / ln n_ref) (Qwen "LogN" attention scaling)     n_ref
llama4         1 + slope ln(floor(n / n_ref) + 1) (Llama 4 temperature     n_ref = floor_scale,
               tuning, applied to the query)                               slope = attn_scale
ssmax          slope ln n (Scalable-Softmax, no reference length)          slope = s
constant       1 + slope for every n                                       slope
=============  =========================================================  ======================

Every law is then capped at ``alpha_max`` when one is given. Every law is non-decreasing in ``n``
for a legal slope (monotone for any), which is what lets :meth:`Law.bounds` find its extremes
at the ends of the range: the contract (checked by the spec) is that alpha stays ``> 0`` for
every ``n >= 2`` and finite in float32 up to ``MAX_N``. ``n = 1`` is left out on purpose: one visible key takes all the mass
whatever the scale (ssmax's ``alpha(1) = 0`` is harmless). Qwen's LogN law is the log-linear law
with ``slope = 1 / ln n_ref``: ``1 + ln(n / n_ref) / ln n_ref = ln n / ln n_ref``; it is computed in
that form, which is exactly 1 up to ``n_ref`` in any precision (the quotient of two rounded
logarithms can land one ulp above 1 at ``n = n_ref`` in float32).

Each :class:`Law` in :data:`REGISTRY` holds its formula written against an array namespace ``xp``
(``numpy`` here, ``torch`` in :mod:`sharpdraft_runtime`) with operations both spell alike
(``xp.log``, ``xp.floor``, ``xp.clip``, ``xp.zeros_like``, arithmetic), so the float64 reference
and the runtime evaluate one definition. The spec's validation (which parameters a law takes)
and the runtime's shortcut (the identity limit, up to which alpha is exactly 1, so scaling can be
skipped) read the same entry. Adding a law is one entry here plus its name in the JSON Schema's
``law`` enum and per-law conditions, which a test keeps equal to the registry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

__all__ = ["Law", "REGISTRY", "LAWS", "MAX_N", "get_law", "alpha_law"]

#: Largest visible-key count the contract covers (and largest n_ref a spec may name): 2^32, far
#: beyond any context window, and exact in float32, the precision the runtime computes alpha in.
MAX_N = 2**32


def _no_slope_moves(slopes) -> bool:
    """True when every slope is exactly 0 (a law with ``alpha = 1 + slope * f(n)`` is then flat)."""
    return not np.any(slopes)


@dataclass(frozen=True)
class Law:
    """One query-scaling law ``alpha(n)``.

    Examples
    --------
    >>> law = get_law("log-linear")
    >>> law.alpha(np, np.array([256.0, 1024.0]), n_ref=512, slope=0.25).tolist()
    [1.0, 1.1732867951399863]
    >>> law.identity_limit(n_ref=512, slopes=np.array(0.25), alpha_max=None)
    512
    """

    name: str  # the spec's `law` value
    formula: Callable  # (xp, n, n_ref, slope) -> uncapped alpha; xp numpy or torch, n floating, slope broadcasts
    needs_n_ref: bool  # n_ref is required; otherwise the law ignores it and a spec may leave it null
    has_slope: bool  # a slope is required; otherwise the law has none and a spec's slope must be null
    min_alpha_max: float  # smallest cap a spec may set (0: any positive cap)
    identity: Callable  # (n_ref, slopes) -> largest n with uncapped alpha(m) == 1 for all m <= n; -1 none, inf all

    def alpha(self, xp, n, *, n_ref: int | None, slope, alpha_max: float | None = None):
        """``alpha(n)`` capped at ``alpha_max``, in ``xp`` (numpy or torch) and ``n``'s floating dtype.

        ``n`` is an ``xp`` array of visible-key counts in a floating dtype; ``slope`` an ``xp``
        array (or None for a law without one) broadcasting with ``n``.
        """
        alpha = self.formula(xp, n, n_ref, slope)
        return alpha if alpha_max is None else xp.clip(alpha, None, alpha_max)

    def bounds(self, *, n_ref: int | None, slopes) -> tuple[float, float]:
        """``(low, high)``: the least uncapped ``alpha(n)`` over ``n >= 2`` (its limit included) and the
        largest over ``2 <= n <= MAX_N``, over every slope, in float32 (the runtime's precision).

        Each law is monotone in ``n``, so the extremes lie at the ends: ``n = 2``, ``n = MAX_N`` and
        the limit ``n -> inf`` (where a zero slope meets an infinite logarithm, ``0 * inf = nan``,
        the law is flat and its value at ``MAX_N`` stands). A slope that overflows float32 (or
        makes ``inf * 0`` at a finite ``n``) gives ``nan``. The spec requires ``low > 0`` and
        ``high`` finite.

        Examples
        --------
        >>> get_law("log-linear").bounds(n_ref=64, slopes=np.array(-1e-6))[0]
        -inf
        >>> get_law("constant").bounds(n_ref=None, slopes=np.array([-0.5, 1.0]))
        (0.5, 2.0)
        """
        n = np.array([2.0, MAX_N, np.inf], dtype=np.float32).reshape(3, 1)
        slope = None if slopes is None else np.asarray(slopes, dtype=np.float64).reshape(1, -1)
        with np.errstate(all="ignore"):
            slope = None if slope is None else slope.astype(np.float32)
            alpha = np.broadcast_to(np.asarray(self.formula(np, n, n_ref, slope), dtype=np.float32),
                                    (3, 1 if slope is None else slope.shape[1])).copy()
        alpha[2] = np.where(np.isnan(alpha[2]), alpha[1], alpha[2])
        if np.isnan(alpha).any():
            return math.nan, math.nan
        return float(alpha.min()), float(alpha[:2].max())

    def identity_limit(self, *, n_ref: int | None, slopes, alpha_max: float | None) -> float:
        """Largest ``n`` such that ``alpha(m) == 1`` exactly for every ``m <= n`` and every slope.

        ``slopes``: all of a spec's slopes (any shape; None for a law without one). ``-1`` when no
        such ``n`` exists (a cap below 1 scales every row), ``inf`` when alpha is 1 everywhere.
        A cap of at least 1 leaves ``alpha == 1`` unchanged.
        """
        if alpha_max is not None and alpha_max < 1:
            return -1
        return self.identity(n_ref, slopes)


REGISTRY: dict[str, Law] = {law.name: law for law in (
    # ln(max(n, n_ref) / n_ref) is exactly 0 up to n_ref.
    Law("log-linear", lambda xp, n, n_ref, slope: 1.0 + slope * xp.log(xp.clip(n, n_ref, None) / n_ref),
        needs_n_ref=True, has_slope=True, min_alpha_max=1.0,
        identity=lambda n_ref, slopes: math.inf if _no_slope_moves(slopes) else n_ref),
    Law("qwen-logn", lambda xp, n, n_ref, slope: 1.0 + xp.log(xp.clip(n, n_ref, None) / n_ref) / math.log(n_ref),
        needs_n_ref=True, has_slope=False, min_alpha_max=0.0,
        identity=lambda n_ref, slopes: n_ref),
    # floor(n / n_ref) is 0 below n_ref.
    Law("llama4", lambda xp, n, n_ref, slope: 1.0 + slope * xp.log(xp.floor(n / n_ref) + 1.0),
        needs_n_ref=True, has_slope=True, min_alpha_max=0.0,
        identity=lambda n_ref, slopes: math.inf if _no_slope_moves(slopes) else n_ref - 1),
    # alpha(1) = 0: never the identity.
    Law("ssmax", lambda xp, n, n_ref, slope: slope * xp.log(xp.clip(n, 1.0, None)),
        needs_n_ref=False, has_slope=True, min_alpha_max=0.0,
        identity=lambda n_ref, slopes: -1),
    Law("constant", lambda xp, n, n_ref, slope: (1.0 + slope) + xp.zeros_like(n),
        needs_n_ref=False, has_slope=True, min_alpha_max=0.0,
        identity=lambda n_ref, slopes: math.inf if _no_slope_moves(slopes) else -1),
)}

LAWS = tuple(REGISTRY)


def get_law(name: str) -> Law:
    """The registry entry of ``name``; ValueError naming the choices when there is none."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown law {name!r}; choose one of {', '.join(LAWS)}") from None


def alpha_law(law: str, n, *, n_ref: int | None = None, slope=None, alpha_max: float | None = None) -> np.ndarray:
    """Query scale ``alpha(n)`` for ``law`` in float64; ``n`` and ``slope`` broadcast together.

    Examples
    --------
    >>> alpha_law("log-linear", [256, 512, 1024], n_ref=512, slope=0.25).tolist()
    [1.0, 1.0, 1.1732867951399863]
    >>> alpha_law("qwen-logn", [4096], n_ref=64).tolist()
    [2.0]
    """
    entry = get_law(law)
    if entry.needs_n_ref and n_ref is None:
        raise ValueError(f"law {law!r} needs n_ref")
    if entry.has_slope and slope is None:
        raise ValueError(f"law {law!r} needs a slope")
    n = np.asarray(n, dtype=np.float64)
    slope = None if slope is None else np.asarray(slope, dtype=np.float64)
    return np.asarray(entry.alpha(np, n, n_ref=n_ref, slope=slope, alpha_max=alpha_max), dtype=np.float64)
