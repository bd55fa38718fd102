"""Arms a user asks for by value: a grid of query scales for the oracle (``eval --slopes / --alphas``).

* ``slope s``: SharpDraft's log-linear law at the drafter's ``n_ref``, ``alpha = 1 + s ln(n / n_ref)``
  past it;
* ``alpha c``: a constant scale past ``n_ref`` (``alpha = 1`` up to it, ``c`` beyond): the tabulated
  law with one knot at ``n_ref + 1``.

Each is an ordinary :class:`~sharpdraft_theory.ScaleSpec`, so the arm the oracle ranks best is a
spec a user can deploy as it is.
"""

from __future__ import annotations

import math
import re

from sharpdraft_theory import ScaleSpec, SpecError
from sharpdraft_theory.spec import AlphaTable

from ..errors import UserError
from .forced import Arm

__all__ = ["parse_grid", "slope_arm", "alpha_arm", "scale_grid"]

MAX_GRID = 64  # arms per grid: each is one more drafter pass per sequence


# A number as it is written: digits with an optional point and exponent (Python's float() also reads 1_0 as 10)
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|[+-]?(nan|inf|infinity)", re.IGNORECASE)


def parse_grid(option: str, text: str | None) -> list[float]:
    """Comma-separated finite numbers, distinct, at most :data:`MAX_GRID` (None: none); an empty item
    (``0.1,,0.2``, ``,,,``) or anything but digits with a point and exponent (``1_0``) is refused."""
    if text is None:
        return []
    items = [x.strip() for x in text.split(",")]
    bad = next((x for x in items if not _NUMBER.fullmatch(x)), None)
    if bad is not None:
        shown = f"{bad!r} is not a number" if bad else "an empty value"
        raise UserError(f"{option} {text}: {shown}; expected comma-separated numbers, e.g. 0.05,0.1,0.2")
    values = [float(x) for x in items]
    bad = [v for v in values if not math.isfinite(v)]
    if bad:
        raise UserError(f"{option} {text}: {bad[0]} is not a finite number")
    if len(set(values)) != len(values):
        raise UserError(f"{option} {text}: a value is given twice")
    if len(values) > MAX_GRID:
        raise UserError(f"{option}: {len(values)} values; give at most {MAX_GRID} (each is one more drafter pass)")
    return values


def slope_arm(slope: float, n_ref: int, top_k: int) -> Arm:
    """``slope s``: log-linear at ``n_ref``."""
    try:
        spec = ScaleSpec(law="log-linear", n_ref=n_ref, slope=float(slope), top_k=top_k)
    except SpecError as err:
        raise UserError(f"--slopes {slope:g}: {err}") from None
    return Arm(f"slope {slope:g}", spec)


def alpha_arm(alpha: float, n_ref: int, top_k: int) -> Arm:
    """``alpha c``: 1 up to ``n_ref``, ``c`` past it."""
    if not 0 < alpha <= 16:
        raise UserError(f"--alphas {alpha:g}: expected a scale in (0, 16], e.g. 0.9,1.1,1.25")
    spec = ScaleSpec(law="tabulated", n_ref=n_ref, slope=None, top_k=top_k,
                     table=AlphaTable(n=(n_ref + 1,), alpha=(float(alpha),)))
    return Arm(f"alpha {alpha:g}", spec)


def scale_grid(slopes: list[float], alphas: list[float], n_ref: int, top_k: int) -> list[Arm]:
    """The oracle's arms, slopes first."""
    return [slope_arm(s, n_ref, top_k) for s in slopes] + [alpha_arm(a, n_ref, top_k) for a in alphas]
