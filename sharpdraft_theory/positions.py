"""Distance fixes: the positions at which a drafter's RoPE logits are computed past its trained distances.

RoPE logits depend on the query position ``i`` and the key position ``j`` only through the distance
``d = i - j`` (``docs/theory.md`` section 9): a drafter trained with at most ``n_ref`` keys per query
has seen no distance above ``n_ref - 1``. A :class:`PositionFix` maps each (query, key) pair to the
positions ``(p_q, p_k)`` at which its logit is computed instead, so that distances stay in the trained
range. Three fixes, each exact::

    clamp (ReRoPE, Su 2023)       d <  W: (i, j)            d >= W: (W, 0)                  -> distance W
    group (Self-Extend, Jin et al. d <  W: (i, j)            d >= W: (i // G + W - W // G, j // G)
           2024, arXiv 2401.01325)
    pi    (position interpolation, every pair: (s i, s j),  s = 2^-k,  k = max(0, ceil(log2((i + 1) / n_ref)))
           Chen et al. 2023, arXiv 2306.15595)

``W`` is the neighbour window (the query's last ``W`` keys, itself included, keep their exact
logits, as a spec's ``window`` counts keys), ``G`` the group size. Self-Extend's grouped distance
``i // G - j // G + W - W // G`` is at least ``W - 1`` and at most ``(N - 1) // G + W - W // G`` in a
sequence of ``N`` keys (the paper's condition ``W + (N - W) / G <= n_ref``, made exact);
:func:`default_group` picks the least ``G`` that keeps it below ``n_ref``. Position interpolation
divides every position of a row by the least power of two that brings its largest distance
``i`` below ``n_ref`` (``n = i + 1`` keys when the row sees the whole sequence): the identity for
``i + 1 <= n_ref``, and rows fall into a few groups (one per power of two), each computed exactly
with one re-rotation of its queries and of the keys. A power of two also scales positions without
rounding.

The mapping is written once against an array namespace ``xp`` (numpy here, torch in
:mod:`sharpdraft_runtime.positions`): :meth:`PositionFix.near`, :meth:`PositionFix.query_position`,
:meth:`PositionFix.key_position` and :meth:`PositionFix.key_group`, combined by :meth:`PositionFix.remap`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .checks import SpecError, check_int, check_record, check_str, field_error
from .laws import MAX_N

__all__ = ["FIXES", "PositionFix", "pi_exponent", "default_group", "default_neighbour_window", "max_distance"]

FIXES = ("clamp", "group", "pi")  # distance fixes a spec can name
_TAKES = {"clamp": ("window",), "group": ("window", "group"), "pi": ("n_ref",)}  # fields each fix reads


def pi_exponent(i, n_ref: int, xp=np):
    """``k = max(0, ceil(log2((i + 1) / n_ref)))`` for query positions ``i``: the row's scale is ``2^-k``.

    Computed exactly in integers: ``k`` is the bit length of ``i // n_ref`` (the least ``k`` with
    ``i + 1 <= n_ref 2^k``, i.e. ``i // n_ref < 2^k``).

    Examples
    --------
    >>> pi_exponent(np.array([0, 255, 256, 511, 512, 1023, 1024]), 256).tolist()
    [0, 0, 1, 1, 2, 2, 3]
    >>> pi_exponent(1024, 256)  # one row, a plain integer: its bit length directly
    3
    """
    if isinstance(i, (int, np.integer)):
        return (int(i) // n_ref).bit_length()
    q = i // n_ref
    k = xp.zeros_like(q)
    for bit in range(63):  # bit length of q (q < 2^63), without a float log
        k = xp.where(q >= 2 ** bit, bit + 1, k)
        if not bool((q >= 2 ** (bit + 1)).any()):
            break
    return k


@dataclass(frozen=True)
class PositionFix:
    """Where a drafter's logits are computed for keys past its trained distances (module docstring)."""

    fix: str  # clamp, group or pi (FIXES)
    window: int | None = None  # W (clamp, group): the query's last W keys keep their positions; None for pi
    group: int | None = None  # G (group): distances past W grouped by floor division by G; None otherwise
    n_ref: int | None = None  # pi: the trained length; a row whose position i has i + 1 > n_ref is interpolated

    def __post_init__(self):
        PositionFix.from_dict({"fix": self.fix, "window": self.window, "group": self.group, "n_ref": self.n_ref})

    @classmethod
    def from_dict(cls, d: dict, where: str = "positions") -> "PositionFix":
        check_record(where, d, cls)
        fix = check_str(f"{where}.fix", d["fix"], FIXES)
        for name in ("window", "group", "n_ref"):
            if name not in _TAKES[fix] and d.get(name) is not None:
                raise field_error(f"{where}.{name}", f"{fix} takes {', '.join(_TAKES[fix])} only; use null", d[name])
            if name in _TAKES[fix] and d.get(name) is None:
                raise SpecError(f"spec field '{where}.{name}': {fix} needs it")
        window = check_int(f"{where}.window", d.get("window"), 1, nullable=True, maximum=MAX_N)
        group = check_int(f"{where}.group", d.get("group"), 2, nullable=True, maximum=MAX_N)
        n_ref = check_int(f"{where}.n_ref", d.get("n_ref"), 2, nullable=True, maximum=MAX_N)
        fixed = object.__new__(cls)
        for name, value in (("fix", fix), ("window", window), ("group", group), ("n_ref", n_ref)):
            object.__setattr__(fixed, name, value)
        return fixed

    def to_dict(self) -> dict:
        return {"fix": self.fix, "window": self.window, "group": self.group, "n_ref": self.n_ref}

    def describe(self) -> str:
        """One line for ``sharpdraft inspect`` and eval's summary."""
        if self.fix == "clamp":
            return f"clamp (ReRoPE): distances >= {self.window} computed as {self.window}"
        if self.fix == "group":
            return (f"group (Self-Extend): the last {self.window} keys exact, farther ones at grouped positions "
                    f"(i // {self.group} + {self.window - self.window // self.group}, j // {self.group})")
        return (f"pi (position interpolation): a row at position i >= {self.n_ref} has its positions divided by "
                f"the least power of 2 that brings i + 1 to {self.n_ref} or below")

    @property
    def identity_limit(self) -> int:
        """Keys ``n`` (query position ``n - 1``, keys from 0) up to which every logit keeps its positions."""
        return self.n_ref if self.fix == "pi" else self.window

    # -- the mapping (xp: numpy or torch) ---------------------------------------------------------
    def near(self, i, j):
        """True where the pair keeps its own positions (``i - j < W``); None for pi (no pair is kept apart)."""
        return None if self.fix == "pi" else (i - j) < self.window

    def key_group(self, i, xp=np):
        """Rows whose far keys share positions: 0 for clamp and group, ``pi_exponent`` for pi."""
        return pi_exponent(i, self.n_ref, xp) if self.fix == "pi" else xp.zeros_like(i)

    def query_position(self, i, xp=np):
        """Position of query ``i`` against its far keys (every key, for pi)."""
        if self.fix == "clamp":
            return xp.full_like(i, self.window)
        if self.fix == "group":
            return i // self.group + (self.window - self.window // self.group)
        return i / 2.0 ** pi_exponent(i, self.n_ref, xp)

    def key_position(self, j, i, xp=np):
        """Position of key ``j`` as a far key of query ``i`` (``i`` matters for pi only)."""
        if self.fix == "clamp":
            return xp.zeros_like(j)
        if self.fix == "group":
            return j // self.group
        return j / 2.0 ** pi_exponent(i, self.n_ref, xp)

    def remap(self, i, j, xp=np):
        """``(p_q, p_k)`` of every pair: query positions ``i`` and key positions ``j`` broadcast together.

        Examples
        --------
        >>> i, j = np.array([[9]]), np.arange(10)[None]
        >>> p_q, p_k = PositionFix("group", window=4, group=2).remap(i, j)
        >>> (p_q - p_k).tolist()
        [[6, 6, 5, 5, 4, 4, 3, 2, 1, 0]]
        >>> p_q, p_k = PositionFix("clamp", window=4).remap(i, j)
        >>> (p_q - p_k).tolist()
        [[4, 4, 4, 4, 4, 4, 3, 2, 1, 0]]
        """
        i, j = xp.broadcast_arrays(i, j) if xp is np else xp.broadcast_tensors(i, j)
        p_q, p_k = self.query_position(i, xp), self.key_position(j, i, xp)
        near = self.near(i, j)
        if near is None:
            return p_q, p_k
        return xp.where(near, i, p_q), xp.where(near, j, p_k)


def max_distance(fix: PositionFix, n: int) -> float:
    """Largest remapped distance ``p_q - p_k`` over causal pairs of a sequence of ``n`` keys (positions 0 .. n-1)."""
    i = np.arange(n)[:, None]
    p_q, p_k = fix.remap(i, np.arange(n)[None])
    return float(np.where(np.arange(n)[None] <= i, p_q - p_k, -np.inf).max())


def default_neighbour_window(fix: str, n_ref: int) -> int:
    """W when none is given: clamp ``n_ref - 1`` (the largest distance trained on, so the fix is the
    identity up to ``n_ref`` keys); group ``n_ref // 2`` (Self-Extend's neighbour window, leaving the
    other half of the trained distances to the groups)."""
    return n_ref - 1 if fix == "clamp" else n_ref // 2


def default_group(n_ref: int, longest: int, window: int) -> int:
    """The least ``G >= 2`` whose grouped distances stay below ``n_ref`` up to ``longest`` keys:
    ``(longest - 1) // G + W - W // G <= n_ref - 1`` (Self-Extend's condition, exact).

    Examples
    --------
    >>> default_group(256, 8192, 128), default_group(256, 2048, 128)
    (64, 16)
    """
    if not 1 <= window < n_ref:
        raise ValueError(f"the neighbour window {window} must be in 1 .. n_ref - 1 = {n_ref - 1}")
    for group in range(2, max(longest, 2) + 1):
        if (longest - 1) // group + window - window // group <= n_ref - 1:
            return group
    return max(longest, 2)  # unreachable: G = longest puts every key of the far part in one group
