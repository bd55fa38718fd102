"""The tabulated law from a calibration: measured alpha where calibrated, a model's beyond.

Mass matching (E1, :mod:`.estimators`) finds in each calibration bucket past ``n_ref`` the alpha
``a_b`` that restores the reference top-k mass; the log-linear law fits one slope through them.
The tabulated law keeps them instead (``laws`` evaluates it, linear in ``ln n`` between knots):

* knots: the buckets past ``n_ref`` whose global ``a_b`` is defined, at their representative
  ``n`` rounded to an integer (the buckets' ranges are disjoint, so the knots stay distinct);
* values: each layer's or head's own ``a_b`` at the spec's granularity; where a group has none
  (out of the alpha grid's reach, or no rows there) the global bucket's;
* past the last calibrated knot ``n_c``: knots at ``n_ref 2^j`` up to ``max_n`` (and ``max_n``
  itself), valued by a model, the one place a model enters, named in the table's
  ``extrapolation``:

  - ``distance-model`` when the statistics hold a distance profile (``calibrate --stats``): the
    distance model's exact correction at each knot (:mod:`.distance`,
    ``DistanceFit.alpha_at``), ``M(a*; n) = M_ref`` at the same granularity, each group held to
    its own E1 reference mass as its calibrated knots are. A value out of the model's reach
    (the reference mass not crossed on the profile's alpha grid, 0.5 to 4) takes the fixed
    slope's, and the table says ``distance-model+fixed-slope``;
  - ``fixed-slope`` without a profile: :func:`extrapolate`, the fixed-slope law from the last
    calibrated knot, ``alpha(n) = a_c + beta ln(n / n_c)`` with the group's E1 slope ``beta``
    floored at 0.

  Either way a falling alpha is not extrapolated: each value is at least the one before it,
  from ``a_c`` on (:func:`never_falling`), so the extrapolated knots are non-decreasing in ``n``.

Past ``max_n`` the runtime holds the last value.
"""

from __future__ import annotations

import numpy as np

from .distance import DistanceFit
from .estimators import SlopeFit
from .spec import GRANULARITIES, AlphaTable

__all__ = ["FIXED_SLOPE", "DISTANCE_MODEL", "MIXED", "extrapolate", "never_falling", "tabulate", "extrapolated_knots"]

#: Names of the extrapolations, recorded in the table (module docstring).
FIXED_SLOPE = "fixed-slope"
DISTANCE_MODEL = "distance-model"
MIXED = f"{DISTANCE_MODEL}+{FIXED_SLOPE}"  # the distance model, the fixed slope where it is out of reach


def extrapolate(n: np.ndarray, n_last: float, alpha_last: np.ndarray, slope: np.ndarray) -> np.ndarray:
    """Alpha at knots ``n`` past the last calibrated knot ``n_last``: the fixed-slope law from it.

    Parameters
    ----------
    n : ndarray of shape (k,)
        Knots past ``n_last``.
    n_last : float
        The last calibrated knot.
    alpha_last : ndarray of shape (...)
        Each group's alpha there.
    slope : ndarray of shape (...)
        Each group's fitted slope ``beta`` (E1), negative ones taken as 0.

    Returns
    -------
    ndarray of shape (..., k)
        ``alpha_last + max(beta, 0) ln(n / n_last)``.

    Examples
    --------
    >>> extrapolate(np.array([4096.0, 8192.0]), 2048.0, np.array(1.3), np.array(0.2)).round(4).tolist()
    [1.4386, 1.5773]
    """
    return alpha_last[..., None] + np.maximum(slope, 0.0)[..., None] * np.log(np.asarray(n, dtype=np.float64) / n_last)


def never_falling(alpha_last: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Each extrapolated value raised to the largest before it, ``alpha_last`` included.

    Parameters
    ----------
    alpha_last : ndarray of shape (...)
        Each group's alpha at the last calibrated knot.
    values : ndarray of shape (..., k)
        The model's values at the knots past it.

    Returns
    -------
    ndarray of shape (..., k)
        ``max(alpha_last, values[..., 0], ..., values[..., j])`` at knot ``j``: a falling alpha holds.

    Examples
    --------
    >>> never_falling(np.array(1.3), np.array([1.2, 1.5, 1.4, 1.6])).tolist()
    [1.3, 1.5, 1.5, 1.6]
    """
    joined = np.concatenate([np.asarray(alpha_last)[..., None], values], axis=-1)
    return np.maximum.accumulate(joined, axis=-1)[..., 1:]


def extrapolated_knots(n_ref: int, n_last: int, max_n: int) -> np.ndarray:
    """Knots past ``n_last`` up to ``max_n``: ``n_ref 2^j``, then ``max_n`` itself when it is not one.

    Examples
    --------
    >>> extrapolated_knots(256, 1950, 20000).tolist()
    [2048, 4096, 8192, 16384, 20000]
    """
    knots = [n_ref * 2**j for j in range(1, 64) if n_last < n_ref * 2**j <= max_n]
    if max_n > n_last and (not knots or knots[-1] != max_n):
        knots.append(max_n)
    return np.array(knots, dtype=np.int64)


def tabulate(fit: SlopeFit, *, n_ref: int, max_n: int,
             distance: DistanceFit | None = None) -> tuple[AlphaTable, int, int]:
    """The tabulated law's table from a fit (module docstring), and how many values were filled.

    Parameters
    ----------
    fit : SlopeFit
        From ``fit_slopes(..., granularity=...)``: its ``buckets``, ``bucket_alpha`` and E1 slopes.
    n_ref : int
        The reference length the fit used.
    max_n : int
        Last knot of the extrapolation (none when the calibration reaches it).
    distance : DistanceFit, optional
        Distance models of the same rows (``fit_distance`` with the same ``n_ref`` and ``top_k``):
        they value the extrapolated knots. None: the fixed slope does.

    Returns
    -------
    table : AlphaTable
        Values shaped as ``fit.slopes`` plus a knots axis.
    filled : int
        Group values taken from the global bucket (the group's own was undefined).
    out_of_reach : int
        Extrapolated values the distance model could not give, taken from the fixed slope (0
        without ``distance``).
    """
    global_alpha = np.array([np.nan if b.alpha is None else b.alpha for b in fit.buckets])
    use = np.array([b.n > n_ref for b in fit.buckets]) & np.isfinite(global_alpha)
    if not use.any():
        raise ValueError(f"no calibration bucket past n_ref={n_ref} has a matched alpha: the reference mass is "
                         "out of the alpha grid's reach there; use --law log-linear")
    knots = np.array([round(b.n) for b in fit.buckets], dtype=np.int64)[use]
    own = fit.bucket_alpha[..., use]
    missing = ~np.isfinite(own)
    values = np.where(missing, global_alpha[use], own)
    beyond = extrapolated_knots(n_ref, int(knots[-1]), max_n)
    name, out_of_reach = None, 0
    if beyond.size:
        slope = np.asarray(fit.slopes["mass-matching"], dtype=np.float64)
        model = extrapolate(beyond, float(knots[-1]), values[..., -1], slope)  # (..., k)
        name = FIXED_SLOPE
        if distance is not None:
            granularity = GRANULARITIES[values.ndim - 1]  # values: (*groups, knots)
            exact = np.moveaxis(distance.alpha_at(beyond, granularity), 0, -1)  # (N, *groups) -> (*groups, N)
            reached = np.isfinite(exact)
            out_of_reach = int(np.count_nonzero(~reached))
            model = np.where(reached, exact, model)
            name = MIXED if out_of_reach else DISTANCE_MODEL
        values = np.concatenate([values, never_falling(values[..., -1], model)], axis=-1)
    table = AlphaTable(n=tuple(int(k) for k in np.concatenate([knots, beyond])), alpha=_tuples(values),
                       measured=int(knots.size), extrapolation=name)
    return table, int(missing.sum()), out_of_reach


def _tuples(values: np.ndarray):
    return tuple(_tuples(v) for v in values) if values.ndim > 1 else tuple(float(v) for v in values)
