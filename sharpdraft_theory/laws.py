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
tabulated      1 for n <= n_ref, then linear in ln n through alpha_j at   n_ref, table
               knots n_j > n_ref, held at the last value past the last
=============  =========================================================  ======================

Every law is then capped at ``alpha_max`` when one is given. Every slope law is non-decreasing in
``n`` for a legal slope (monotone for any), which is what lets :meth:`Law.bounds` find its extremes
at the ends of the range: the contract (checked by the spec) is that alpha stays ``> 0`` for
every ``n >= 2`` and finite in float32 up to ``MAX_N`` (for the tabulated law: each value in the
table ``> 0`` and finite in float32). ``n = 1`` is left out on purpose: one visible key takes all the mass
whatever the scale (ssmax's ``alpha(1) = 0`` is harmless). Qwen's LogN law is the log-linear law
with ``slope = 1 / ln n_ref``: ``1 + ln(n / n_ref) / ln n_ref = ln n / ln n_ref``; it is computed in
that form, which is exactly 1 up to ``n_ref`` in any precision (the quotient of two rounded
logarithms can land one ulp above 1 at ``n = n_ref`` in float32).

The tabulated law is what calibration measures, written down: alpha at log-spaced knots
(``n_0 = n_ref`` with alpha 1, implicit, then the spec's table ``n_1 < ... < n_m``), linear in
``ln n`` between knots and held at ``alpha_m`` past ``n_m`` (a table reaches as far as something
measured or modelled it; the runtime does not extrapolate). Between two positive values a line
stays positive, so the table's values being ``> 0`` keeps alpha ``> 0``.

Each :class:`Law` in :data:`REGISTRY` holds its formula written against an array namespace ``xp``
(``numpy`` here, ``torch`` in :mod:`sharpdraft_runtime`, :class:`ScalarNamespace` for one plain
float) with operations they all spell alike (``xp.log``, ``xp.floor``, ``xp.clip``,
``xp.zeros_like``, ``xp.searchsorted``, ``xp.take``, arithmetic), so the float64 reference and
the runtime evaluate one definition. A law's parameter is a slope (an array broadcasting with ``n``), a table (a :class:`KnotTable`, built once per
layer by :meth:`Law.compile`) or nothing. The spec's validation (which parameters a law takes)
and the runtime's shortcut (the identity limit, up to which alpha is exactly 1, so scaling can be
skipped) read the same entry. Adding a law is one entry here plus its name in the JSON Schema's
``law`` enum and per-law conditions, which a test keeps equal to the registry.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

__all__ = ["Law", "KnotTable", "ScalarNamespace", "REGISTRY", "LAWS", "MAX_N", "get_law", "alpha_law"]

#: Largest visible-key count the contract covers (and largest n_ref a spec may name): 2^32, far
#: beyond any context window, and exact in float32, the precision the runtime computes alpha in.
MAX_N = 2**32


def _no_slope_moves(slopes) -> bool:
    """True when every slope is exactly 0 (a law with ``alpha = 1 + slope * f(n)`` is then flat)."""
    return not np.any(slopes)


@dataclass(frozen=True)
class KnotTable:
    """A tabulated law's table for one layer (or a whole global spec), compiled for one namespace.

    With ``d = ln(n / n_ref)`` and knots ``0 = d_0 < d_1 < ... < d_m``, segment ``j`` covers
    ``d_j <= d < d_{j+1}`` (the last one, ``j = m``, everything past ``d_m``); on it::

        alpha = intercept_j + gradient_j d,   gradient_j = (alpha_{j+1} - alpha_j) / (d_{j+1} - d_j),
                                              intercept_j = alpha_j - gradient_j d_j,

    with ``gradient_m = 0``. ``d`` is ``ln(clip(n, n_ref, n_m) / n_ref)``, so it is exactly 0 up to
    ``n_ref`` where ``alpha = intercept_0 = 1`` exactly, and one ``searchsorted`` finds ``j``.
    Per-head tables are laid end to end; ``offset`` points at each one's first segment and has
    the shape of the values' leading axes, so it broadcasts with ``n`` as a slope array would.

    Examples
    --------
    >>> t = KnotTable.build(256, [512, 1024], [[1.5, 1.5], [1.2, 2.0]], np.asarray)
    >>> t.intercept.reshape(2, 3).round(6).tolist()
    [[1.0, 1.5, 1.5], [1.0, 0.4, 2.0]]
    >>> t.offset.tolist()
    [0, 3]
    """

    n_last: float  # the last knot n_m: n is clipped to [n_ref, n_m] before the logarithm
    inner: Any  # (m,) d_1..d_m, ascending: knots other than n_ref, as ln(n_j / n_ref)
    intercept: Any  # (tables * (m + 1),) intercept_j of every segment, tables end to end
    gradient: Any  # (tables * (m + 1),) gradient_j of every segment (0 on each table's last)
    offset: Any  # first segment of each table, shaped like the values' leading axes; None for a single table

    @classmethod
    def build(cls, n_ref: int, knots, values, asarray: Callable) -> "KnotTable":
        """Compile ``values`` (``(..., m)``: alpha at ``knots``, ``(m,)`` integers > ``n_ref``) in float64.

        ``asarray`` turns a numpy array into the namespace's array: float64 ones into the
        evaluation dtype, the int64 ``offset`` into an integer array (``np.asarray`` for numpy).
        """
        knots = np.asarray(knots, dtype=np.float64)  # (m,)
        values = np.asarray(values, dtype=np.float64)  # (..., m)
        lead, m = values.shape[:-1], knots.size
        d = np.concatenate([[0.0], np.log(knots / n_ref)])  # (m + 1,)
        alpha = np.concatenate([np.ones(lead + (1,)), values], axis=-1)  # (..., m + 1)
        gradient = np.zeros_like(alpha)
        gradient[..., :-1] = np.diff(alpha, axis=-1) / np.diff(d)
        intercept = alpha - gradient * d  # d_0 = 0: intercept_0 = 1 exactly
        offset = None if not lead else asarray(np.arange(int(np.prod(lead)), dtype=np.int64).reshape(lead) * (m + 1))
        return cls(n_last=float(knots[-1]), inner=asarray(d[1:]), intercept=asarray(intercept.reshape(-1)),
                   gradient=asarray(gradient.reshape(-1)), offset=offset)


def _tabulated(xp, n, n_ref, table: KnotTable):
    """alpha(n) of a :class:`KnotTable`; ``n`` broadcasts with ``table.offset``."""
    d = xp.log(xp.clip(n, n_ref, table.n_last) / n_ref)  # ln(n / n_ref): exactly 0 up to n_ref
    j = xp.searchsorted(table.inner, d, side="right")  # segment: knots past n_ref at or below n
    if table.offset is not None:
        j = j + table.offset  # each table's own segments
    return xp.take(table.intercept, j) + xp.take(table.gradient, j) * d


class ScalarNamespace:
    """The array namespace of one plain float ``n``: what the formulas call, in Python's float64 arithmetic.

    For one visible-key count (a decoding step), a formula costs a few Python operations this way,
    against several device kernels on a one-element tensor. A slope is a float and a table's arrays
    are lists (:meth:`Law.compile` with ``asarray=ScalarNamespace.asarray``); one table only.

    Examples
    --------
    >>> law = get_law("log-linear")
    >>> slope = law.compile(0.25, n_ref=512, asarray=ScalarNamespace.asarray)
    >>> law.alpha(ScalarNamespace, 1024.0, n_ref=512, param=slope)
    1.1732867951399863
    """

    log = staticmethod(math.log)
    floor = staticmethod(math.floor)

    @staticmethod
    def asarray(array: np.ndarray):
        """A numpy array as Python numbers: a float for a 0-d array, else (nested) lists."""
        return array.tolist()

    @staticmethod
    def clip(x, low, high):
        x = x if low is None else max(x, low)
        return x if high is None else min(x, high)

    @staticmethod
    def zeros_like(x):
        return 0.0

    @staticmethod
    def searchsorted(a, v, side="left"):
        return (bisect.bisect_right if side == "right" else bisect.bisect_left)(a, v)

    @staticmethod
    def take(a, j):
        return a[j]


@dataclass(frozen=True)
class Law:
    """One query-scaling law ``alpha(n)``.

    Examples
    --------
    >>> law = get_law("log-linear")
    >>> law.alpha(np, np.array([256.0, 1024.0]), n_ref=512, param=np.array(0.25)).tolist()
    [1.0, 1.1732867951399863]
    >>> law.identity_limit(n_ref=512, values=np.array(0.25), alpha_max=None)
    512
    """

    name: str  # the spec's `law` value
    formula: Callable  # (xp, n, n_ref, param) -> uncapped alpha; xp numpy or torch, n floating, param from `compile`
    needs_n_ref: bool  # n_ref is required; otherwise the law ignores it and a spec may leave it null
    parameter: str | None  # "slope" (the spec's `slope`), "table" (the spec's `table`) or None (neither)
    min_alpha_max: float  # smallest cap a spec may set (0: any positive cap)
    identity: Callable  # (n_ref, values) -> largest n with uncapped alpha(m) == 1 for all m <= n; -1 none, inf all

    @property
    def has_slope(self) -> bool:
        return self.parameter == "slope"

    @property
    def has_table(self) -> bool:
        return self.parameter == "table"

    def compile(self, values, *, n_ref: int | None, knots=None, asarray: Callable = np.asarray):
        """The formula's ``param`` from a spec's values for one layer (or a global spec).

        ``values``: slopes broadcasting with ``n``, or a table's alpha with a trailing knots axis
        (``knots`` then gives its knots), already arranged to broadcast with ``n``; None for a law
        without a parameter. ``asarray`` as in :meth:`KnotTable.build`.
        """
        if self.parameter == "table":
            return KnotTable.build(n_ref, knots, values, asarray)
        return None if values is None else asarray(np.asarray(values, dtype=np.float64))

    def alpha(self, xp, n, *, n_ref: int | None, param, alpha_max: float | None = None):
        """``alpha(n)`` capped at ``alpha_max``, in ``xp`` (numpy or torch) and ``n``'s floating dtype.

        ``n`` is an ``xp`` array of visible-key counts in a floating dtype; ``param`` what
        :meth:`compile` made (None for a law without a parameter), broadcasting with ``n``.
        """
        alpha = self.formula(xp, n, n_ref, param)
        return alpha if alpha_max is None else xp.clip(alpha, None, alpha_max)

    def bounds(self, *, n_ref: int | None, values) -> tuple[float, float]:
        """``(low, high)``: the least uncapped ``alpha(n)`` over ``n >= 2`` (its limit included) and the
        largest over ``2 <= n <= MAX_N``, over every slope, in float32 (the runtime's precision).

        ``values``: all of a spec's slopes (None for a law without one). Each slope law is monotone
        in ``n``, so the extremes lie at the ends: ``n = 2``, ``n = MAX_N`` and the limit
        ``n -> inf`` (where a zero slope meets an infinite logarithm, ``0 * inf = nan``, the law is
        flat and its value at ``MAX_N`` stands). A slope that overflows float32 (or makes
        ``inf * 0`` at a finite ``n``) gives ``nan``. The spec requires ``low > 0`` and ``high``
        finite. Not for the tabulated law, whose extremes are its values (and 1): the spec checks
        those one by one.

        Examples
        --------
        >>> get_law("log-linear").bounds(n_ref=64, values=np.array(-1e-6))[0]
        -inf
        >>> get_law("constant").bounds(n_ref=None, values=np.array([-0.5, 1.0]))
        (0.5, 2.0)
        """
        with np.errstate(all="ignore"):
            n = np.array([2.0, MAX_N, np.inf], dtype=np.float32).reshape(3, 1)
            slope = None if values is None else np.asarray(values, dtype=np.float64).reshape(1, -1).astype(np.float32)
            alpha = np.broadcast_to(np.asarray(self.formula(np, n, n_ref, slope), dtype=np.float32),
                                    (3, 1 if slope is None else slope.shape[1])).copy()
        alpha[2] = np.where(np.isnan(alpha[2]), alpha[1], alpha[2])
        if np.isnan(alpha).any():
            return math.nan, math.nan
        return float(alpha.min()), float(alpha[:2].max())

    def identity_limit(self, *, n_ref: int | None, values, alpha_max: float | None) -> float:
        """Largest ``n`` such that ``alpha(m) == 1`` exactly for every ``m <= n``, layer and head.

        ``values``: all of a spec's slopes or table values (any shape; None for a law without a
        parameter). ``-1`` when no such ``n`` exists (a cap below 1 scales every row), ``inf`` when
        alpha is 1 everywhere. A cap of at least 1 leaves ``alpha == 1`` unchanged.
        """
        if alpha_max is not None and alpha_max < 1:
            return -1
        return self.identity(n_ref, values)


REGISTRY: dict[str, Law] = {law.name: law for law in (
    # ln(max(n, n_ref) / n_ref) is exactly 0 up to n_ref.
    Law("log-linear", lambda xp, n, n_ref, slope: 1.0 + slope * xp.log(xp.clip(n, n_ref, None) / n_ref),
        needs_n_ref=True, parameter="slope", min_alpha_max=1.0,
        identity=lambda n_ref, slopes: math.inf if _no_slope_moves(slopes) else n_ref),
    Law("qwen-logn", lambda xp, n, n_ref, slope: 1.0 + xp.log(xp.clip(n, n_ref, None) / n_ref) / math.log(n_ref),
        needs_n_ref=True, parameter=None, min_alpha_max=0.0,
        identity=lambda n_ref, slopes: n_ref),
    # floor(n / n_ref) is 0 below n_ref.
    Law("llama4", lambda xp, n, n_ref, slope: 1.0 + slope * xp.log(xp.floor(n / n_ref) + 1.0),
        needs_n_ref=True, parameter="slope", min_alpha_max=0.0,
        identity=lambda n_ref, slopes: math.inf if _no_slope_moves(slopes) else n_ref - 1),
    # alpha(1) = 0: never the identity.
    Law("ssmax", lambda xp, n, n_ref, slope: slope * xp.log(xp.clip(n, 1.0, None)),
        needs_n_ref=False, parameter="slope", min_alpha_max=0.0,
        identity=lambda n_ref, slopes: -1),
    Law("constant", lambda xp, n, n_ref, slope: (1.0 + slope) + xp.zeros_like(n),
        needs_n_ref=False, parameter="slope", min_alpha_max=0.0,
        identity=lambda n_ref, slopes: math.inf if _no_slope_moves(slopes) else -1),
    # Exactly 1 up to n_ref (KnotTable); past it, 1 only if every value is.
    Law("tabulated", _tabulated, needs_n_ref=True, parameter="table", min_alpha_max=0.0,
        identity=lambda n_ref, values: math.inf if np.all(np.asarray(values) == 1.0) else n_ref),
)}

LAWS = tuple(REGISTRY)


def get_law(name: str) -> Law:
    """The registry entry of ``name``; ValueError naming the choices when there is none."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown law {name!r}; choose one of {', '.join(LAWS)}") from None


def alpha_law(law: str, n, *, n_ref: int | None = None, slope=None, table=None,
              alpha_max: float | None = None) -> np.ndarray:
    """Query scale ``alpha(n)`` for ``law`` in float64; ``n`` broadcasts with ``slope`` (or the table's values).

    ``table``: ``(knots, values)`` for the tabulated law, ``values`` of shape ``(..., len(knots))``
    whose leading axes broadcast with ``n`` (a slope array's would).

    Examples
    --------
    >>> alpha_law("log-linear", [256, 512, 1024], n_ref=512, slope=0.25).tolist()
    [1.0, 1.0, 1.1732867951399863]
    >>> alpha_law("qwen-logn", [4096], n_ref=64).tolist()
    [2.0]
    >>> alpha_law("tabulated", [100, 362.04, 512, 4096], n_ref=256, table=([512, 1024], [1.5, 2.0])).round(4).tolist()
    [1.0, 1.25, 1.5, 2.0]
    """
    entry = get_law(law)
    if entry.needs_n_ref and n_ref is None:
        raise ValueError(f"law {law!r} needs n_ref")
    given = {"slope": slope, "table": table}
    if entry.parameter is not None and given[entry.parameter] is None:
        raise ValueError(f"law {law!r} needs a {entry.parameter}")
    n = np.asarray(n, dtype=np.float64)
    if entry.has_table:
        param = entry.compile(table[1], n_ref=n_ref, knots=table[0])
    else:
        param = entry.compile(slope if entry.has_slope else None, n_ref=n_ref)
    return np.asarray(entry.alpha(np, n, n_ref=n_ref, param=param, alpha_max=alpha_max), dtype=np.float64)
