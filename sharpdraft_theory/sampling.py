"""Speculative sampling's verification rule, in float64 (no torch).

Speculative sampling (Leviathan et al., 2023, arXiv:2211.17192, Algorithm 1; Chen et al., 2023,
arXiv:2302.01318): the drafter draws ``x ~ q``, the target accepts it with probability
``min(1, p(x) / q(x))`` and, at a rejection, draws its own token from the residual
``norm(max(0, p - q))``. The emitted token then follows ``p`` exactly, whatever ``q`` is.

Notes
-----
With ``a(x) = min(1, p(x) / q(x))`` (:func:`accept_probability`) and the residual
``r = max(0, p - q) / sum(max(0, p - q))`` (:func:`residual`), the emitted token's law is

.. math::

    P(y) = q(y) a(y) + \\Big(1 - \\sum_x q(x) a(x)\\Big) r(y)
         = \\min(p(y), q(y)) + \\Big(1 - \\sum_x \\min(p(x), q(x))\\Big) r(y) = p(y),

since ``1 - sum min(p, q) = sum max(0, p - q)``, the residual's normaliser
(:func:`emitted_law` computes the left side). ``sum min(p, q)`` is the chance one draft is
accepted (:func:`acceptance_rate`). Tokens the drafter cannot draw (``q(x) = 0``) are never
proposed and reach the output through the residual only; when ``p = q`` nothing is ever rejected
and the residual is never drawn from (it is defined as ``p`` there).

Every distribution here is a float64 vector over one vocabulary (last axis).

Examples
--------
>>> import numpy as np
>>> p, q = np.array([0.5, 0.3, 0.2, 0.0]), np.array([0.1, 0.1, 0.4, 0.4])
>>> emitted_law(p, q).round(12).tolist()
[0.5, 0.3, 0.2, 0.0]
>>> float(acceptance_rate(p, q))
0.4
"""

from __future__ import annotations

import numpy as np

__all__ = ["softmax", "accept_probability", "residual", "emitted_law", "acceptance_rate", "inverse_cdf"]


def softmax(logits, temperature: float = 1.0) -> np.ndarray:
    """``softmax(logits / temperature)`` over the last axis, in float64; ``-inf`` logits get probability 0."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def accept_probability(p_x, q_x):
    """``min(1, p(x) / q(x))``, the chance the target keeps a draft ``x`` the drafter drew with
    probability ``q(x)``; 1 where ``q(x) = 0`` (such a token is never drafted, and ``q(x) a(x) = 0``
    either way)."""
    p_x, q_x = np.asarray(p_x, dtype=np.float64), np.asarray(q_x, dtype=np.float64)
    return np.where(q_x > p_x, p_x / np.where(q_x > 0, q_x, 1.0), 1.0)


def residual(p, q) -> np.ndarray:
    """``norm(max(0, p - q))``: what the target draws from after rejecting a draft; ``p`` where
    ``p <= q`` everywhere (then no draft is ever rejected)."""
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    r = np.maximum(p - q, 0.0)
    total = r.sum(axis=-1, keepdims=True)
    return np.where(total > 0, r / np.where(total > 0, total, 1.0), p)


def acceptance_rate(p, q):
    """``sum_x min(p(x), q(x))``: the chance a draft ``x ~ q`` is accepted."""
    return np.minimum(np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)).sum(axis=-1)


def emitted_law(p, q) -> np.ndarray:
    """The law of the token one verification emits (the accepted draft, or a residual draw), from
    :func:`accept_probability` and :func:`residual` as the rule applies them; equals ``p``."""
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    kept = q * accept_probability(p, q)  # (..., V) draft drawn and kept
    return kept + (1.0 - kept.sum(axis=-1, keepdims=True)) * residual(p, q)


def inverse_cdf(probs, u: float) -> int:
    """The index ``i`` with ``cdf[i - 1] <= u * total < cdf[i]``: a draw from ``probs`` (1-D, need not
    sum to 1) by one uniform ``u`` in [0, 1). The same ``u`` gives the same token under nearby laws,
    which keeps runs from one random stream paired."""
    probs = np.asarray(probs, dtype=np.float64)
    cdf = np.cumsum(probs)
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return i if i < len(cdf) else int(np.flatnonzero(probs)[-1])  # u * total rounded up to the total
