"""Intervals by bootstrap over sequences: the unit of every interval (rows of one sequence are not independent).

``paired_bootstrap`` is the mean of per-sequence sums with its 95% percentile interval; ``sharpdraft
eval`` reads its deltas with it, ``sharpdraft plot`` its budget band.
"""

from __future__ import annotations

import numpy as np

__all__ = ["RESAMPLES", "paired_bootstrap"]

RESAMPLES = 2000  # bootstrap resamples of the sequences


def paired_bootstrap(numerator: np.ndarray, denominator: np.ndarray | None = None, *, resamples: int = RESAMPLES,
                     seed: int = 0, weights: np.ndarray | None = None) -> list[float] | None:
    """``[mean, lo, hi]`` of ``sum(numerator) / sum(denominator)`` with a 95% bootstrap over sequences.

    Parameters
    ----------
    numerator : array of shape (sequences,) or (sequences, buckets)
        Per sequence: a paired difference (hits of a variant minus hits of ``none`` on the same
        rows), or a value. With a buckets axis the statistic is the ``weights``-average over
        buckets of each bucket's ``sum(numerator) / sum(denominator)`` (every resample draws whole
        sequences, all their buckets together).
    denominator : array of the shape of ``numerator``, optional
        Per sequence: rows (default: 1 each, so the statistic is the mean over sequences).
    weights : array of shape (buckets,), optional
        Bucket weights (normalised here; default equal).
    resamples : int
        Resamples of the sequences (0: no interval).

    Returns
    -------
    [mean, lo, hi] or None
        ``lo``, ``hi``: 2.5% and 97.5% percentiles of the statistic over ``resamples`` resamples
        of the sequences with replacement (the same resamples for every call with the same
        number of sequences and ``seed``, so intervals of different variants are paired too).
        None when the denominator is 0. With one sequence there is nothing to resample, so ``lo``
        and ``hi`` are None (a zero-width interval would claim a certainty one sequence cannot give);
        so they are with no resamples.

    Examples
    --------
    >>> paired_bootstrap(np.array([1.0, 1.0, 1.0]))
    [1.0, 1.0, 1.0]
    >>> paired_bootstrap(np.array([3.0]), np.array([4.0]))
    [0.75, None, None]
    """
    numerator = np.asarray(numerator, dtype=np.float64)
    denominator = np.ones_like(numerator) if denominator is None else np.asarray(denominator, dtype=np.float64)
    numerator, denominator = numerator.reshape(len(numerator), -1), denominator.reshape(len(numerator), -1)  # (S, B)
    w = np.ones(numerator.shape[1]) if weights is None else np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    if (denominator.sum(0) == 0).any():
        return None
    mean = float((numerator.sum(0) / denominator.sum(0)) @ w)
    if len(numerator) < 2 or resamples < 1:
        return [mean, None, None]
    picks = np.random.default_rng(seed).integers(0, len(numerator), size=(resamples, len(numerator)))  # (R, S)
    with np.errstate(invalid="ignore", divide="ignore"):
        stats = (numerator[picks].sum(1) / denominator[picks].sum(1)) @ w  # (R,), nan where a resample has no rows
    lo, hi = np.nanpercentile(stats, [2.5, 97.5])
    return [mean, float(lo), float(hi)]
