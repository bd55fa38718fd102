"""Distance-profile score model: a background whose logits depend on the query-key distance.

Real attention rows are not i.i.d. (theory.md section 7): the logit of a key depends on its
distance ``d`` to the query, and the first key is a sink. This module predicts the top-k mass at
lengths past the calibrated ones, and the exact correction ``a*(n)``, from such a profile.

Distances are 1-based: a query at position ``i`` sees key ``j`` at ``d = i - j + 1``, so its own
key is at ``d = 1`` and, in a row of ``n`` keys, the sink (position 0) at ``d = n``. Every weight
is taken relative to the row's largest logit ``t0`` (which removes the query's offset, the part of
``q . k`` shared by all keys of a row, and keeps every weight in ``(0, 1]``)::

    P(a, d)     = E[exp(a (z_d - t0)) | d]            the profile: mean weight of a background key
    S_T,r(a)    = sum_{j in T_r} exp(a (z_j - t0_r))    top set of anchor row r (A1: fixed in n)
    S_B,r(a)    = the rest of row r's own n_r keys, sink included

A row measured at ``n_r`` keys and extended to ``n`` keys keeps its keys (the sink keeps its
logit, distances ``1 .. n_r - 1`` keep theirs) and gains keys at distances ``n_r .. n - 1``, whose
weights are replaced by their mean (the annealed sum A3, but only for the new keys)::

    S_B,r(a; n) = S_B,r(a) + sum_{d = n_r}^{n - 1} P(a, d)
    M(a; n)     = sum_r w_r S_T,r / (S_T,r + S_B,r(a; n)) / sum_r w_r

with row weights ``w_r`` (1, or bootstrap multiplicities). The profile is piecewise constant on
log-spaced distance bins where it was measured and follows a fitted tail past the largest
measured distance ``D``::

    ln P(a, d) = c(a) + e(a) ln d                                          (d >= D)
    sum_{d=u}^{v-1} P(a, d) ~= e^{c} int_{u-1/2}^{v-1/2} x^{e} dx        (midpoint rule)

Two tail forms are fitted over the last ``octaves`` of measured distances, weighted by keys:

* ``power``: ``c(a)``, ``e(a)`` free at each ``a`` (a power law in ``d`` per query scale);
* ``lognormal``: ``z - t0 | d ~ N(mu(d), v(d))`` with ``mu`` and ``v`` linear in ``ln d``, so
  ``ln P = a mu(d) + a^2 v(d) / 2``: ``c = a m0 + a^2 v0 / 2``, ``e = a m1 + a^2 v1 / 2``.

``e(a) > -1`` means the background keeps growing with ``n`` (the log-odds fall by
``(1 + e) ln n`` asymptotically: the local dilution exponent ``gamma -> 1 + e(1)``), ``e(a) < -1``
that it converges (dilution stops).

**Special case.** One anchor row with ``n_r = k`` and no background of its own, and a flat profile
``P(a, d) = exp(K(a))``, gives ``S_B(a; n) = (n - k) exp(K(a))``: the i.i.d. annealed model of
``sharpdraft_theory.models`` (``M = expit(g(a) - ln(n - k))``).

**Exact correction.** ``a*(n)`` solves ``M(a*; n) = M_ref`` (the mean mass at ``n_ref``, ``a = 1``).
``M`` is tabulated on the profile's grid of ``a`` and interpolated monotonically (PCHIP) between
grid points; ``M(a; n)`` is non-increasing in ``n`` at every ``a`` (keys only add weight), so the
horizon, the first ``n`` where no grid ``a`` reaches ``M_ref``, is found by bisection in ``ln n``.

:func:`exact_alpha` is the function that tabulates ``a*(n)``; :func:`fit_distance` builds the
models per group (global, layer, head) from calibration statistics, with a bootstrap over
sequences for the band.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import numpy as np
from scipy.interpolate import PchipInterpolator
from scipy.special import expit, logsumexp

__all__ = ["TAIL_FORMS", "DistanceProfile", "DistanceModel", "DistanceCorrection", "exact_alpha", "fit_tail", "crossing",
           "DistanceAlpha", "DistanceFit", "fit_distance"]

#: Tail forms of the profile past the largest measured distance (module docstring).
TAIL_FORMS = ("power", "lognormal")

_HORIZON_MAX_N = 2.0**40  # the horizon search stops here (reported as inf beyond)
_UNDERFLOW = -700.0  # tail ln P at an a whose weights all underflowed: e^-700 per key, nothing next to the top


def _midpoint_log_sum(tail: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``ln sum_{d=lo}^{hi-1} exp(c + e ln d)`` by the midpoint rule; -inf where ``hi <= lo``.

    tail: (2, A); lo, hi: (R,) -> (R, A). The integral of ``x^e`` from ``u`` to ``v`` is
    ``u^p L expm1(p L) / (p L)`` with ``p = e + 1``, ``L = ln(v / u)``: no cancellation at ``p = 0``.
    """
    lo = np.asarray(lo, dtype=np.float64)[:, None] - 0.5
    hi = np.asarray(hi, dtype=np.float64)[:, None] - 0.5
    some = hi > lo
    u = np.where(some, lo, 1.0)
    L = np.log(np.where(some, hi, 2.0) / u)  # (R, 1)
    p = tail[1][None, :] + 1.0  # (1, A)
    x = p * L
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(np.abs(x) > 1e-12, np.expm1(x) / np.where(x == 0, 1.0, x), 1.0)
        out = tail[0][None, :] + p * np.log(u) + np.log(L) + np.log(ratio)
    return np.where(some, out, -np.inf)


@dataclass(frozen=True, eq=False)
class DistanceProfile:
    """Mean background weight ``P(a, d)`` per distance bin, and its tail past the last bin.

    Examples
    --------
    A flat profile sums to (number of keys) x weight:

    >>> import numpy as np
    >>> p = DistanceProfile.from_tail([1.0], np.array([[np.log(2.0)], [0.0]]))
    >>> round(float(np.exp(p.log_sum([4], [104]))[0, 0]), 9)  # 100 keys of weight 2
    200.0
    """

    alpha: np.ndarray  # (A,) query scales, increasing
    edges: np.ndarray  # (B + 1,) int: bin b holds distances edges[b] <= d < edges[b + 1]; edges[0] >= 1
    log_weight: np.ndarray  # (B, A) ln P(a, d) in bin b (-inf: no weight measured)
    tail: np.ndarray  # (2, A) c(a), e(a): ln P(a, d) = c + e ln d for d >= edges[-1]

    def __post_init__(self):
        alpha = np.atleast_1d(np.asarray(self.alpha, dtype=np.float64))
        edges = np.asarray(self.edges, dtype=np.int64)
        lw = np.asarray(self.log_weight, dtype=np.float64)
        tail = np.asarray(self.tail, dtype=np.float64)
        if alpha.ndim != 1 or np.any(np.diff(alpha) <= 0):
            raise ValueError("DistanceProfile.alpha must be a 1-D increasing grid")
        if edges.ndim != 1 or edges.size < 2 or edges[0] < 1 or np.any(np.diff(edges) <= 0):
            raise ValueError("DistanceProfile.edges must increase from at least 1")
        if lw.shape != (edges.size - 1, alpha.size) or tail.shape != (2, alpha.size):
            raise ValueError(f"DistanceProfile: log_weight must be {(edges.size - 1, alpha.size)} and tail "
                             f"{(2, alpha.size)}, got {lw.shape} and {tail.shape}")
        if not np.all(np.isfinite(tail)):
            raise ValueError("DistanceProfile.tail must be finite")
        for name, value in (("alpha", alpha), ("edges", edges), ("log_weight", lw), ("tail", tail)):
            object.__setattr__(self, name, value)

    @classmethod
    def from_tail(cls, alpha, tail, exact_below: int = 64) -> "DistanceProfile":
        """The tail form at every distance: one bin per distance below ``exact_below``, the form beyond."""
        alpha = np.atleast_1d(np.asarray(alpha, dtype=np.float64))
        tail = np.asarray(tail, dtype=np.float64)
        d = np.arange(1, exact_below + 1)
        log_weight = tail[0][None, :] + np.log(d[:-1])[:, None] * tail[1][None, :]
        return cls(alpha=alpha, edges=d, log_weight=log_weight, tail=tail)

    @classmethod
    def from_sums(cls, alpha, edges, sums, counts, *, tail: str = "power", octaves: float = 2.0) -> "DistanceProfile":
        """Profile from summed weights: ``sums`` (B, A) of ``exp(a (z - t0))`` over ``counts`` (B,) keys.

        Trailing bins without keys are dropped; the tail is fitted over the last ``octaves``
        (:func:`fit_tail`).
        """
        sums, counts = np.asarray(sums, dtype=np.float64), np.asarray(counts, dtype=np.float64)
        filled = np.flatnonzero(counts > 0)
        if filled.size == 0:
            raise ValueError("no background keys in any distance bin")
        last = int(filled[-1]) + 1
        edges = np.asarray(edges, dtype=np.int64)[: last + 1]
        sums, counts = sums[:last], counts[:last]
        with np.errstate(divide="ignore", invalid="ignore"):
            log_weight = np.where((counts[:, None] > 0) & (sums > 0), np.log(sums / counts[:, None]), -np.inf)
        coef, _ = fit_tail(alpha, edges, log_weight, counts, form=tail, octaves=octaves)
        return cls(alpha=alpha, edges=edges, log_weight=log_weight, tail=coef)

    @property
    def max_distance(self) -> int:
        """Largest distance covered by the bins: the tail starts at ``edges[-1]``."""
        return int(self.edges[-1]) - 1

    def log_sum(self, lo, hi) -> np.ndarray:
        """``ln sum_{d=lo}^{hi-1} P(a, d)`` per pair: lo, hi (R,) -> (R, A); -inf for an empty range."""
        lo = np.atleast_1d(np.asarray(lo, dtype=np.int64))
        hi = np.atleast_1d(np.asarray(hi, dtype=np.int64))
        e = self.edges
        overlap = np.clip(np.minimum(hi[:, None], e[None, 1:]) - np.maximum(lo[:, None], e[None, :-1]), 0, None)  # (R, B)
        top = np.max(np.where(np.isfinite(self.log_weight), self.log_weight, -np.inf), axis=0)  # (A,)
        top = np.where(np.isfinite(top), top, 0.0)
        with np.errstate(divide="ignore"):
            binned = np.log(overlap.astype(np.float64) @ np.exp(self.log_weight - top)) + top  # (R, A)
        tail = _midpoint_log_sum(self.tail, np.maximum(lo, e[-1]), hi)
        return np.logaddexp(binned, tail)

    def log_weight_at(self, d) -> np.ndarray:
        """``ln P(a, d)`` at single distances: (D,) -> (D, A)."""
        d = np.atleast_1d(np.asarray(d, dtype=np.int64))
        return self.log_sum(d, d + 1)


def fit_tail(alpha, edges, log_weight, counts, *, form: str = "power", octaves: float = 2.0
             ) -> tuple[np.ndarray, float]:
    """Fit ``ln P(a, d) = c(a) + e(a) ln d`` over the bins in the last ``octaves`` of distance.

    Parameters
    ----------
    alpha : (A,) query scales.
    edges : (B + 1,) bin edges; ``log_weight`` (B, A) and ``counts`` (B,) keys per bin.
    form : {"power", "lognormal"}
        ``power``: a line in ``ln d`` at each ``a``; ``lognormal``: ``c = a m0 + a^2 v0 / 2``,
        ``e = a m1 + a^2 v1 / 2`` (mean and variance of ``z - t0`` linear in ``ln d``).
    octaves : float
        Fit bins whose lower edge is at least ``edges[-1] / 2**octaves``.

    Returns
    -------
    tail : (2, A) ``c`` and ``e``.
    rms : float
        Key-weighted root mean square residual of ``ln P`` over the fitted bins (nats).

    Notes
    -----
    Each bin sits at the mean of ``ln d`` over its distances (``ln`` of the geometric mean),
    weighted least squares by keys; bins without weight at some ``a`` are left out at that ``a``.
    An ``a`` where fewer than two bins hold weight (all of it below float32's range: large ``a``,
    keys far below the top) gets the flat tail ``ln P = -700``.
    """
    if form not in TAIL_FORMS:
        raise ValueError(f"tail form must be one of {', '.join(TAIL_FORMS)}, got {form!r}")
    alpha = np.atleast_1d(np.asarray(alpha, dtype=np.float64))
    edges = np.asarray(edges, dtype=np.int64)
    lw = np.asarray(log_weight, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.float64)
    x = _log_centres(edges.tobytes())  # (B,)
    use = (edges[:-1] >= edges[-1] / 2.0**octaves) & (counts > 0)
    if np.count_nonzero(use) < 2:
        use = counts > 0  # too few bins in the window: fit all measured bins
    ok = use[:, None] & np.isfinite(lw)  # (B, A)
    fitted = np.count_nonzero(ok, axis=0) >= 2  # (A,): a's whose weights did not all underflow
    if not fitted.any():
        raise ValueError("the distance profile has fewer than two measured bins: no tail can be fitted")
    ok &= fitted[None, :]
    w = np.sqrt(np.where(ok, counts[:, None], 0.0))  # (B, A)
    y = np.where(ok, lw, 0.0)
    if form == "power":  # weighted least squares of a line, one per a, in closed form
        w2 = np.where(fitted[None, :], w**2, 1.0)  # unfitted a's: any finite line, replaced below
        mx = np.sum(w2 * x[:, None], axis=0) / np.sum(w2, axis=0)  # (A,)
        my = np.sum(w2 * y, axis=0) / np.sum(w2, axis=0)
        dx = x[:, None] - mx
        slope = np.sum(w2 * dx * (y - my), axis=0) / np.sum(w2 * dx**2, axis=0)
        coef = np.stack([my - slope * mx, slope])
        coef = np.where(fitted[None, :], coef, np.array([[_UNDERFLOW], [0.0]]))
    else:
        a = alpha[None, :]
        xx = x[:, None]
        cols = [a + 0 * xx, a * xx, 0.5 * a * a + 0 * xx, 0.5 * a * a * xx]  # each (B, A)
        design = np.stack([(c * w).ravel() for c in cols], axis=1)
        m0, m1, v0, v1 = np.linalg.lstsq(design, (y * w).ravel(), rcond=None)[0]
        coef = np.stack([alpha * m0 + 0.5 * alpha**2 * v0, alpha * m1 + 0.5 * alpha**2 * v1])
        coef = np.where(fitted[None, :], coef, np.array([[_UNDERFLOW], [0.0]]))
    resid = np.where(ok, lw - (coef[0][None, :] + x[:, None] * coef[1][None, :]), 0.0)
    rms = float(np.sqrt(np.sum(w**2 * resid**2) / np.sum(w**2)))
    return coef, rms


@functools.lru_cache(maxsize=16)
def _log_centres(edges_bytes: bytes) -> np.ndarray:
    """Mean of ``ln d`` over the distances of each bin (edges given as int64 bytes, for the cache)."""
    edges = np.frombuffer(edges_bytes, dtype=np.int64)
    return np.array([np.mean(np.log(np.arange(lo, hi))) for lo, hi in zip(edges[:-1], edges[1:])])


@dataclass(frozen=True, eq=False)
class DistanceModel:
    """Anchor rows extended by a distance profile (module docstring).

    Row ``r`` uses ``profiles[group[r]]``; its quantities are relative to its largest logit.

    Examples
    --------
    The i.i.d. limit: one row of ``k = 4`` top logits at 6, flat background at 0 (``K = 0``):

    >>> import numpy as np
    >>> flat = DistanceProfile.from_tail([1.0], np.zeros((2, 1)))
    >>> m = DistanceModel.single(flat, top=np.full(4, 6.0))
    >>> round(float(m.mass([1028])[0, 0]), 6)  # expit(ln 4 + 6 - ln 1024)
    0.611785
    """

    profiles: tuple  # DistanceProfile per group, sharing one alpha grid
    group: np.ndarray  # (R,) int: profile of each row
    n_row: np.ndarray  # (R,) int: keys the row was measured with; new keys sit at distances n_row .. n - 1
    log_top: np.ndarray  # (R, A) ln S_T,r(a) relative to the row's largest logit
    log_rest: np.ndarray  # (R, A) ln S_B,r(a) of the row's own keys, same reference (-inf: none)
    weight: np.ndarray  # (R,) row weights of the mean mass (bootstrap multiplicities)

    def __post_init__(self):
        rows = np.asarray(self.n_row).shape[0]
        alpha = self.profiles[0].alpha
        for p in self.profiles[1:]:
            if p.alpha.shape != alpha.shape or not np.allclose(p.alpha, alpha):
                raise ValueError("DistanceModel: every profile must share one alpha grid")
        for name, shape in (("group", (rows,)), ("n_row", (rows,)), ("log_top", (rows, alpha.size)),
                            ("log_rest", (rows, alpha.size)), ("weight", (rows,))):
            value = np.asarray(getattr(self, name))
            if value.shape != shape:
                raise ValueError(f"DistanceModel.{name}: expected shape {shape}, got {value.shape}")
            object.__setattr__(self, name, value)
        if rows == 0:
            raise ValueError("DistanceModel needs at least one anchor row")

    @classmethod
    def single(cls, profile: DistanceProfile, top) -> "DistanceModel":
        """One row: the planted top logits ``top`` and a background made only of profile keys.

        ``top`` is on the profile's scale (softmax is shift invariant: only the gap matters). The
        row starts at ``n_row = k`` keys with no background, so at ``n`` it holds the ``n - k``
        profile keys at distances ``k .. n - 1``.
        """
        top = np.asarray(top, dtype=np.float64).ravel()
        log_top = logsumexp(profile.alpha[:, None] * top[None, :], axis=1)
        return cls(profiles=(profile,), group=np.zeros(1, np.int64), n_row=np.array([top.size]),
                   log_top=log_top[None, :], log_rest=np.full((1, profile.alpha.size), -np.inf), weight=np.ones(1))

    @property
    def alpha(self) -> np.ndarray:
        return self.profiles[0].alpha

    def log_background(self, n) -> np.ndarray:
        """``ln S_B,r(a; n)``: (N,) -> (N, R, A)."""
        n = np.atleast_1d(np.asarray(n, dtype=np.int64))
        out = np.empty((n.size, self.n_row.size, self.alpha.size))
        for g, profile in enumerate(self.profiles):
            rows = np.flatnonzero(self.group == g)
            if rows.size == 0:
                continue
            lo = np.broadcast_to(self.n_row[rows], (n.size, rows.size)).ravel()
            hi = np.repeat(n, rows.size)
            new = profile.log_sum(lo, hi).reshape(n.size, rows.size, -1)  # (N, R_g, A)
            out[:, rows] = np.logaddexp(self.log_rest[rows][None], new)
        return out

    def log_odds(self, n) -> np.ndarray:
        """Per-row top-k log-odds ``ln S_T,r - ln S_B,r(a; n)``: (N, R, A)."""
        return self.log_top[None] - self.log_background(n)

    def mass(self, n) -> np.ndarray:
        """Mean top-k mass ``M(a; n)`` over the rows (weighted): (N, A)."""
        w = self.weight / self.weight.sum()
        return np.einsum("nra,r->na", expit(self.log_odds(n)), w)


@dataclass(frozen=True)
class DistanceCorrection:
    """Exact correction under a distance model; ``alpha`` is NaN exactly where not ``reachable``."""

    n: np.ndarray  # (N,) lengths asked for
    alpha: np.ndarray  # (N,) a*(n) with M(a*; n) = mass_ref; NaN off the grid's reach
    reachable: np.ndarray  # (N,) bool: the reference mass is reached inside the alpha grid
    horizon_n: float  # first length where no grid alpha reaches mass_ref (inf: none below 2^40)


_FINE = 0.0025  # spacing of the alpha grid the PCHIP interpolant is evaluated on to find a crossing


def crossing(alpha: np.ndarray, curves: np.ndarray, target) -> np.ndarray:
    """First ``a`` where the PCHIP interpolant of each curve reaches ``target``; NaN if none.

    curves: (..., A) on ``alpha``; target broadcastable to ``curves.shape[:-1]``. The interpolant
    is read on a grid of step ``_FINE`` and the crossing interpolated linearly there.
    """
    alpha = np.asarray(alpha, dtype=np.float64)
    curves = np.asarray(curves, dtype=np.float64)
    target = np.broadcast_to(np.asarray(target, dtype=np.float64), curves.shape[:-1])
    if alpha.size >= 3:
        fine = np.linspace(alpha[0], alpha[-1], int(np.ceil((alpha[-1] - alpha[0]) / _FINE)) + 1)
        values = np.moveaxis(PchipInterpolator(alpha, curves, axis=-1)(fine), -1, -1)
    else:
        fine, values = alpha, curves
    above = values >= target[..., None]
    i = np.argmax(above, axis=-1)
    ok = above.any(axis=-1) & ((i > 0) | (values[..., 0] == target))
    lo = np.maximum(i - 1, 0)
    v_lo = np.take_along_axis(values, lo[..., None], -1)[..., 0]
    v_hi = np.take_along_axis(values, i[..., None], -1)[..., 0]
    frac = np.where(v_hi > v_lo, (target - v_lo) / np.where(v_hi > v_lo, v_hi - v_lo, 1.0), 0.0)
    return np.where(ok, fine[lo] + frac * (fine[i] - fine[lo]), np.nan)


def exact_alpha(model: DistanceModel, n, *, mass_ref: float) -> DistanceCorrection:
    """Exact correction ``a*(n)``: the query scale with mean top-k mass ``M(a*; n) = mass_ref``.

    Parameters
    ----------
    model : DistanceModel
        Anchor rows and profile(s) (one group, or a mixture whose mean mass is matched).
    n : array_like of int
        Visible key counts.
    mass_ref : float
        Target mass, usually the mean mass at ``n_ref`` and ``a = 1``.

    Notes
    -----
    ``M(a; n)`` is tabulated on ``model.alpha`` and interpolated by PCHIP (monotone where the
    data are); the root is the first crossing (``crossing``). The horizon is the first ``n`` where
    ``max_a M(a; n) < mass_ref``; ``M`` is non-increasing in ``n`` at every ``a`` (new keys only
    add weight), so it is found by bisection in ``ln n``.

    Examples
    --------
    Two-level limit (background weight 1, top set of 4 at gap 5): ``a* = 1 + ln r / 5``.

    >>> import numpy as np
    >>> flat = DistanceProfile.from_tail(np.linspace(0.5, 3.0, 251), np.zeros((2, 251)))
    >>> m = DistanceModel.single(flat, top=np.full(4, 5.0))
    >>> ref = float(expit(np.log(4) + 5 - np.log(508)))
    >>> c = exact_alpha(m, [4 + 508 * 148], mass_ref=ref)  # ln r = ln 148 ~= 4.997
    >>> round(float(c.alpha[0]), 4)
    1.9994
    """
    n = np.atleast_1d(np.asarray(n, dtype=np.int64))
    curves = model.mass(n)  # (N, A)
    alpha = crossing(model.alpha, curves, mass_ref)
    return DistanceCorrection(n=n, alpha=alpha, reachable=np.isfinite(alpha), horizon_n=_horizon(model, mass_ref))


def _horizon(model: DistanceModel, mass_ref: float) -> float:
    def reaches(n: float) -> bool:
        return bool(model.mass([int(round(n))])[0].max() >= mass_ref)

    lo = float(model.n_row.max())
    if not reaches(lo):
        return lo
    if reaches(_HORIZON_MAX_N):
        return float("inf")
    hi = _HORIZON_MAX_N
    while hi / lo > 1.001:
        mid = np.sqrt(lo * hi)
        lo, hi = (mid, hi) if reaches(mid) else (lo, mid)
    return float(hi)


# -- models from calibration statistics -------------------------------------------------------------------------------
@dataclass(frozen=True)
class DistanceAlpha:
    """``a*(n)`` per group from calibration statistics, with a bootstrap band over sequences."""

    n: np.ndarray  # (N,) lengths
    alpha: np.ndarray  # (N, *groups) point estimate; NaN where the reference mass is out of the grid's reach
    low: np.ndarray  # (N, *groups) 2.5% bootstrap percentile (NaN: no bootstrap, or too few finite draws)
    high: np.ndarray  # (N, *groups) 97.5% bootstrap percentile
    mass_ref: np.ndarray  # (*groups) the reference mass each group is held to
    horizon_n: np.ndarray  # (*groups) first length of a 4-per-octave ladder where no grid alpha reaches mass_ref


@dataclass(frozen=True, eq=False)
class DistanceFit:
    """Distance models of every (layer, head) of a calibration, evaluated at any granularity.

    Built by :func:`fit_distance`. For a length ``n`` the anchor rows are the measured rows with
    ``n_r`` in ``(m / sqrt 2, m]``, ``m = min(n, longest measured n)``: past the calibrated lengths
    the longest rows are extended by the profile, inside them the rows near ``n`` are (exact up to
    the half-octave). Each head has its own profile; a layer's or the global mass is the mean over
    all anchor rows of its heads.
    """

    n_ref: int  # reference length: mass_ref is the mean mass there at a = 1
    top_k: int  # size of the top set
    tail: str  # tail form of the profiles (TAIL_FORMS)
    octaves: float  # tail fitted over this many octaves of the largest distances
    alpha: np.ndarray  # (A,) query scales of the profile
    edges: np.ndarray  # (B + 1,) distance bins
    shape: tuple  # (layers, heads)
    seq_weight: np.ndarray  # (S, L * H, B, A) summed weights per sequence and head
    seq_keys: np.ndarray  # (S, L * H, B) background keys per sequence and head
    row_n: np.ndarray  # (R,) keys of each measured row
    row_head: np.ndarray  # (R,) layer * heads + head
    row_seq: np.ndarray  # (R,) index of the row's sequence in seq_weight
    log_top: np.ndarray  # (R, A) ln S_T(a) relative to the row's largest logit
    log_rest: np.ndarray  # (R, A) ln S_B(a) of the row's own keys, same reference
    table: object  # the estimators' row table (mass_ref by mass matching, E1)

    @property
    def sequences(self) -> int:
        return int(self.seq_weight.shape[0])

    def profiles(self, seq_weights=None) -> tuple:
        """One ``DistanceProfile`` per head, from the sequences' sums weighted by ``seq_weights``."""
        c = np.ones(self.sequences) if seq_weights is None else np.asarray(seq_weights, dtype=np.float64)
        weight = np.einsum("s,shba->hba", c, self.seq_weight)
        keys = np.einsum("s,shb->hb", c, self.seq_keys)
        return tuple(DistanceProfile.from_sums(self.alpha, self.edges, weight[h], keys[h], tail=self.tail,
                                               octaves=self.octaves) for h in range(weight.shape[0]))

    def _groups(self, granularity: str) -> tuple[np.ndarray, tuple]:
        layers, heads = self.shape
        if granularity == "global":
            return np.zeros(layers * heads, np.int64), ()
        if granularity == "layer":
            return np.repeat(np.arange(layers), heads), (layers,)
        if granularity == "head":
            return np.arange(layers * heads), (layers, heads)
        raise ValueError(f"granularity must be global, layer or head, got {granularity!r}")

    def mass(self, n, granularity: str = "global", seq_weights=None, profiles=None, anchor: int | None = None
             ) -> np.ndarray:
        """Predicted mean mass ``M(a; n)``: (N, *groups, A).

        ``anchor``: extend the rows near ``min(anchor, longest measured n)`` to every ``n`` instead
        of the rows near ``min(n, longest)`` (``sharpdraft_theory.drift`` extends the rows at the
        end of the seen distances).
        """
        n = np.atleast_1d(np.asarray(n, dtype=np.int64))
        c = np.ones(self.sequences) if seq_weights is None else np.asarray(seq_weights, dtype=np.float64)
        profiles = self.profiles(c) if profiles is None else profiles
        of_head, shape = self._groups(granularity)
        groups = int(np.prod(shape)) if shape else 1
        total = np.zeros((n.size, groups, self.alpha.size))
        weight_sum = np.zeros((n.size, groups))
        longest = int(self.row_n.max())
        window = np.minimum(n if anchor is None else np.full(n.size, int(anchor)), longest)  # lengths past the
        # calibrated ones share the longest rows
        for m in np.unique(window):
            at = np.flatnonzero(window == m)  # lengths using this window, (N_m,)
            rows = (self.row_n <= m) & (self.row_n > m / np.sqrt(2.0)) & (c[self.row_seq] > 0)
            for h in np.unique(self.row_head[rows]):
                r = np.flatnonzero(rows & (self.row_head == h))
                lo = np.tile(self.row_n[r], at.size)
                new = profiles[h].log_sum(lo, np.repeat(n[at], r.size)).reshape(at.size, r.size, -1)  # (N_m, R_h, A)
                mass = expit(self.log_top[r][None] - np.logaddexp(self.log_rest[r][None], new))
                w = c[self.row_seq[r]]
                total[at, of_head[h]] += np.einsum("nra,r->na", mass, w)
                weight_sum[at, of_head[h]] += w.sum()
        with np.errstate(invalid="ignore"):
            out = total / weight_sum[..., None]
        return out.reshape((n.size, *shape, self.alpha.size))

    def mass_ref(self, granularity: str = "global", seq_weights=None) -> np.ndarray:
        """Mean mass at ``n_ref``, ``a = 1`` per group, as the mass-matching estimator (E1) reads it."""
        from .estimators import _Table, mass_matching

        of_head, shape = self._groups(granularity)
        by = () if granularity == "global" else (_Table.LAYER,) if granularity == "layer" else (_Table.LAYER, _Table.HEAD)
        weights = None
        if seq_weights is not None:
            seqs = np.unique(self.table.keys[:, _Table.SEQ], return_inverse=True)[1].ravel()
            weights = np.asarray(seq_weights, dtype=np.float64)[seqs]
        cells = self.table.cells(by, weights=weights)
        ref = mass_matching(cells, self.n_ref).mass_ref
        out = np.full(shape if shape else (1,), np.nan)
        if shape:
            out[tuple(cells.groups.T)] = ref
            return out
        return ref

    def alpha_at(self, n, granularity: str = "global", profiles=None) -> np.ndarray:
        """``a*(n)`` per group, ``M(a*; n) = mass_ref``: (N, *groups); NaN where the grid does not reach it."""
        _, shape = self._groups(granularity)
        ref = self.mass_ref(granularity).reshape(shape)
        return crossing(self.alpha, self.mass(n, granularity, profiles=profiles), ref)

    def exact_alpha(self, n, granularity: str = "global", *, bootstrap: int = 0, seed: int = 0) -> DistanceAlpha:
        """``a*(n)`` per group (:meth:`alpha_at`), with the horizon and a percentile band over sequence resamples."""
        n = np.atleast_1d(np.asarray(n, dtype=np.int64))
        _, shape = self._groups(granularity)
        ref = self.mass_ref(granularity).reshape(shape)
        profiles = self.profiles()
        alpha = self.alpha_at(n, granularity, profiles=profiles)
        ladder = np.unique(np.round(self.row_n.max() * 2.0 ** (np.arange(0, 4 * 30 + 1) / 4)).astype(np.int64))  # 4/octave
        ladder = ladder[ladder <= _HORIZON_MAX_N]
        peak = self.mass(ladder, granularity, profiles=profiles).max(axis=-1)  # (ladder, *groups)
        short = peak < ref
        horizon = np.where(short.any(axis=0), ladder[np.argmax(short, axis=0)], np.inf)
        low = high = np.full(alpha.shape, np.nan)
        if bootstrap > 0 and self.sequences > 1:
            rng = np.random.default_rng(seed)
            draws = rng.multinomial(self.sequences, np.full(self.sequences, 1.0 / self.sequences), size=bootstrap)
            samples = np.stack([crossing(self.alpha, self.mass(n, granularity, seq_weights=c),
                                         self.mass_ref(granularity, seq_weights=c).reshape(shape))
                                for c in draws.astype(np.float64)])
            enough = np.isfinite(samples).sum(axis=0) >= max(10, bootstrap // 2)
            with warnings.catch_warnings():  # all-NaN slices (never reached) are masked just below
                warnings.simplefilter("ignore", RuntimeWarning)
                lo, hi = np.nanpercentile(samples, [2.5, 97.5], axis=0)
            low, high = np.where(enough, lo, np.nan), np.where(enough, hi, np.nan)
        return DistanceAlpha(n=n, alpha=alpha, low=low, high=high, mass_ref=ref, horizon_n=horizon)


def fit_distance(stats, *, n_ref: int, top_k: int, tail: str = "power", octaves: float = 2.0) -> DistanceFit:
    """Distance models of every (layer, head) from calibration statistics (``RowStats`` with a profile).

    Parameters
    ----------
    stats : RowStats
        Rows and their ``distance`` statistics (``calibrate --stats``).
    n_ref : int
        Reference length (``mass_ref`` as mass matching, E1, reads it).
    top_k : int
        Size of the top set.
    tail, octaves
        Tail form and fit window of the profiles (:func:`fit_tail`).

    Examples
    --------
    >>> import numpy as np
    >>> from sharpdraft_theory.stats import distance_edges, row_stats_from_logits
    >>> z = np.random.default_rng(0).normal(size=(64, 512)) - 0.5 * np.log1p(np.arange(512))[::-1]
    >>> n = np.tile([128, 181, 256, 362, 512], 13)[:64]
    >>> z = np.where(np.arange(512) < n[:, None], z, -np.inf)
    >>> stats = row_stats_from_logits(z, k_max=4, seq=np.arange(64) % 4, edges=distance_edges(512))
    >>> fit = fit_distance(stats, n_ref=256, top_k=4)
    >>> fit.mass([2048]).shape  # (N, A): global mean mass on the profile's alpha grid
    (1, 10)
    """
    from .estimators import _Table

    dist = stats.distance
    if dist is None:
        raise ValueError("these statistics hold no distance profile: recalibrate with this version (--stats)")
    if not 1 <= top_k <= stats.k_max:
        raise ValueError(f"top_k={top_k} must be between 1 and k_max={stats.k_max} of these statistics")
    grid = stats.alpha_grid
    at = np.array([int(np.argmin(np.abs(grid - a))) for a in dist.alpha])
    if not np.allclose(grid[at], dist.alpha):
        raise ValueError("the distance profile's alpha values are not on the rows' alpha grid")
    keep = stats.n > top_k
    s = stats.select(keep)
    layers, heads = dist.rows.shape[1:]
    top = s.top[:, :1].astype(np.float64)  # (R, 1) t0
    a = dist.alpha[None, :]
    log_top = s.log_top(top_k)[:, at] - a * top  # (R, A)
    lse = s.lse[:, at].astype(np.float64)
    share = np.minimum(np.exp(s.log_top(top_k)[:, at] - lse), 1.0 - 1e-15)
    log_rest = lse + np.log1p(-share) - a * top  # (R, A)
    seq_index = np.searchsorted(dist.seq, s.seq)
    if np.any(dist.seq[np.minimum(seq_index, dist.seq.size - 1)] != s.seq):
        raise ValueError("rows and distance profile hold different sequences")
    return DistanceFit(
        n_ref=n_ref, top_k=top_k, tail=tail, octaves=octaves, alpha=dist.alpha.astype(np.float64), edges=dist.edges,
        shape=(layers, heads), seq_weight=dist.weight.reshape(dist.seq.size, layers * heads, *dist.weight.shape[3:]),
        seq_keys=dist.keys.reshape(dist.seq.size, layers * heads, -1), row_n=s.n.astype(np.int64),
        row_head=(s.layer.astype(np.int64) * heads + s.head), row_seq=seq_index, log_top=log_top, log_rest=log_rest,
        table=_Table.of_rows(s, n_ref, top_k))
