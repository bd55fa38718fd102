"""Rounding and intervals as results hold them, and as tables print them.

A result (``sharpdraft eval``'s JSON, ``calibrate.measure``'s buckets) keeps 4 decimals of a mean and
of the ends of its interval, and None where a number is missing or not finite (JSON has no NaN):
:func:`rounded`, :func:`rounded_triple` for ``[mean, lo, hi]`` (``sharpdraft_theory.bootstrap.
paired_bootstrap``'s value), :func:`rounded_interval` for its ``[lo, hi]``. A table prints 3 decimals:
:func:`fixed` and :func:`signed_triple`.

    >>> rounded(0.123456), rounded(float("nan")), rounded_triple([0.5, None, None])
    (0.1235, None, [0.5, None, None])
    >>> rounded_interval([0.5, 0.25, 0.75]), rounded_interval([0.5, None, None])
    ([0.25, 0.75], None)
    >>> fixed(None), fixed(0.5), signed_triple([0.01, -0.02, 0.04]), signed_triple([0.01, None, None])
    ('-', '0.500', '+0.010 [-0.020, +0.040]', '+0.010 (no interval)')
"""

from __future__ import annotations

import math

__all__ = ["rounded", "rounded_triple", "rounded_interval", "fixed", "signed_triple"]


def rounded(x: float | None, digits: int = 4) -> float | None:
    """``x`` to ``digits`` decimals as a Python float; None for None, NaN and infinities."""
    return None if x is None or not math.isfinite(x) else round(float(x), digits)


def rounded_triple(values: list[float | None] | None) -> list[float | None] | None:
    """``[mean, lo, hi]`` (an interval end may be None) rounded; None stays None."""
    return None if values is None else [rounded(v) for v in values]


def rounded_interval(values: list[float | None] | None) -> list[float] | None:
    """``[lo, hi]`` of ``[mean, lo, hi]`` rounded; None without an interval."""
    return None if values is None or values[1] is None else [rounded(values[1]), rounded(values[2])]


def fixed(x: float | None, digits: int = 3) -> str:
    """``x`` with ``digits`` decimals, ``-`` for None."""
    return "-" if x is None else f"{x:.{digits}f}"


def signed_triple(triple: list[float | None] | None) -> str:
    """``[mean, lo, hi]`` as ``+0.010 [-0.020, +0.040]`` (no interval: said so; None: empty)."""
    if triple is None:
        return ""
    if triple[1] is None:
        return f"{triple[0]:+.3f} (no interval)"
    return f"{triple[0]:+.3f} [{triple[1]:+.3f}, {triple[2]:+.3f}]"
