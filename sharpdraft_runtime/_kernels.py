"""The compiled loops of :mod:`sharpdraft_runtime.fused` (numba; imported on first use, cached on disk).

Far key ``j`` of a decoding step is rotated by the angles ``(a j + b (j // G) + c) inv_freq``. Its cos
and sin come from row ``j - 1``'s by angle addition in float64 (one of two fixed steps: ``a``, or
``a + b`` where ``j // G`` grows), exact again every ``ANCHOR`` rows, and are formed for ``CHUNK`` rows
at a time (a 16 KB table that stays in the first-level cache), so no table over the whole context is
made. A block of query rows (:func:`block_logits`) rotates its far keys by their own law (``c = 0``), its
rows' queries rotated to their far positions beforehand. Rotation is rotate-half RoPE; dimensions past
``2 len(inv_freq)`` (partial rotary) are not rotated.

Floating-point: ``reassoc`` and ``contract`` let the dot products vectorise (their sums are reordered, a
float32 rounding); infinities and NaNs keep their meaning (no ``nnan`` / ``ninf``).
"""

from __future__ import annotations

import math

import numba
import numpy as np

ANCHOR = 1024  # rows between exact angles: float64 angle addition drifts ~1e-16 a row, far below float32
CHUNK = 64  # rows whose cos and sin are formed at once (64 x 32 x 4 B x 2 = 16 KB for 64 frequencies)
_FAST = {"reassoc", "contract", "nsz", "arcp"}


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _steps(a, b, freq):
    """cos and sin (float64, (4, half)) of one row's step ``a`` and of the step where ``j // G`` grows, ``a + b``."""
    half = freq.shape[0]
    out = np.empty((4, half))
    for p in range(half):
        out[0, p], out[1, p] = math.cos(a * freq[p]), math.sin(a * freq[p])
        out[2, p], out[3, p] = math.cos((a + b) * freq[p]), math.sin((a + b) * freq[p])
    return out


@numba.njit(cache=True, nogil=True, fastmath=_FAST, inline="always")
def _angle_state(a, b, inv_freq):
    """What :func:`_fill` works with: the float64 frequencies, their steps (:func:`_steps`), the running angle
    (2, half) and one chunk's float32 cos and sin (CHUNK, half)."""
    freq = inv_freq.astype(np.float64)
    half = freq.shape[0]
    cos, sin = np.empty((CHUNK, half), np.float32), np.empty((CHUNK, half), np.float32)
    return freq, _steps(a, b, freq), np.empty((2, half)), cos, sin


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def _fill(j0, rows, a, b, G, c, freq, steps, run, cos, sin):
    """``cos``, ``sin`` (CHUNK, half) float32 of rows ``j0 .. j0 + rows - 1``; ``run`` (2, half) float64 holds row
    ``j0 - 1``'s angle on entry (anything when ``j0`` is an anchor) and row ``j0 + rows - 1``'s on return."""
    half = freq.shape[0]
    for t in range(rows):
        j = j0 + t
        if j % ANCHOR == 0:
            shift = a * j + b * (j // G) + c  # exact (integers or dyadic) in float64
            for p in range(half):
                run[0, p], run[1, p] = math.cos(shift * freq[p]), math.sin(shift * freq[p])
        else:
            k = 2 if b != 0.0 and j % G == 0 else 0
            for p in range(half):
                x, y = run[0, p], run[1, p]
                run[0, p] = x * steps[k, p] - y * steps[k + 1, p]
                run[1, p] = y * steps[k, p] + x * steps[k + 1, p]
        for p in range(half):
            cos[t, p], sin[t, p] = run[0, p], run[1, p]


@numba.njit(cache=True, nogil=True, fastmath=_FAST, inline="always")
def _rotate_row(x, y, cos, sin):
    """``y``: the key row ``x`` rotated by the angles whose ``cos`` and ``sin`` (half,) are given (rotate-half RoPE;
    dimensions past ``2 half``, partial rotary, copied)."""
    half = cos.shape[0]
    for p in range(half):
        x1, x2 = x[p], x[p + half]
        y[p] = x1 * cos[p] - x2 * sin[p]
        y[p + half] = x2 * cos[p] + x1 * sin[p]
    for p in range(2 * half, x.shape[0]):
        y[p] = x[p]


@numba.njit(cache=True, nogil=True, fastmath=_FAST, inline="always")
def _dot(q, x):
    """``q . x`` in float32 (vectorised: the sum reordered)."""
    s = np.float32(0.0)
    for p in range(x.shape[0]):
        s += q[p] * x[p]
    return s


@numba.njit(cache=True, nogil=True, fastmath=_FAST, inline="always")
def _dot_heads(query, bb, heads, x, out, j, scaling):
    """``out[bb, r, 0, j]``: ``scaling`` times query row ``query[bb, r, 0]`` dotted with the key row ``x``, for
    each query head ``r`` in ``heads`` (those that share ``x``'s key head)."""
    for r in heads:
        out[bb, r, 0, j] = _dot(query[bb, r, 0], x) * scaling


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def rotate_far(key, out, far, a, b, G, c, inv_freq):
    """``out``: ``key``'s (B, H, T, D) rows ``j < far`` rotated by their angles, the rest copied."""
    B, H, T, D = key.shape
    freq, steps, run, cos, sin = _angle_state(a, b, inv_freq)
    for j0 in range(0, far, CHUNK):
        rows = min(CHUNK, far - j0)
        _fill(j0, rows, a, b, G, c, freq, steps, run, cos, sin)
        for bb in range(B):
            for h in range(H):
                for t in range(rows):
                    _rotate_row(key[bb, h, j0 + t], out[bb, h, j0 + t], cos[t], sin[t])
    for bb in range(B):
        for h in range(H):
            out[bb, h, far:] = key[bb, h, far:]


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def far_logits(query, key, out, far, a, b, G, c, inv_freq, scaling):
    """``out`` (B, heads, 1, T): ``scaling`` times the logits of ``query`` (B, heads, 1, D) against ``key``
    (B, H, T, D), rows ``j < far`` rotated by their angles (never written), the rest as they are; query
    heads ``g h .. g h + g - 1`` (``g = heads / H``) read key head ``h`` (GQA, as ``repeat_kv`` pairs them)."""
    B, H, T, D = key.shape
    g = query.shape[1] // H
    freq, steps, run, cos, sin = _angle_state(a, b, inv_freq)
    rot = np.empty(D, np.float32)
    for j0 in range(0, far, CHUNK):
        rows = min(CHUNK, far - j0)
        _fill(j0, rows, a, b, G, c, freq, steps, run, cos, sin)
        for bb in range(B):
            for h in range(H):
                for t in range(rows):
                    _rotate_row(key[bb, h, j0 + t], rot, cos[t], sin[t])
                    _dot_heads(query, bb, range(g * h, g * h + g), rot, out, j0 + t, scaling)
    for bb in range(B):
        for h in range(H):
            for j in range(far, T):
                _dot_heads(query, bb, range(g * h, g * h + g), key[bb, h, j], out, j, scaling)


@numba.njit(cache=True, nogil=True, fastmath=_FAST)
def block_logits(query, q_far, key, rows_at, window, out, far, a, b, G, inv_freq, scaling):
    """``out`` (B, heads, r, T): ``scaling`` times the logits of a block's ``r`` query rows, at positions ``rows_at``
    (r,), against ``key`` (B, H, T, D) at slots ``0 .. T - 1``. A pair is near while ``i - j < window``: ``query``
    (B, heads, r, D) dotted with the key as it is; a far one: ``q_far`` (the rows rotated to their far positions)
    dotted with key ``j`` rotated by ``(a j + b (j // G)) inv_freq``. Keys from ``far`` on are near for every row.
    Query heads ``g h .. g h + g - 1`` read key head ``h`` (GQA).

    ``CHUNK`` keys at a time are rotated into a small buffer that stays in the first-level cache (never a copy of
    all keys), then every row and query head that shares their key head dots them: row ``i``'s far keys are a
    prefix (``j <= i - window``), so its loop splits in two without a test per pair."""
    B, H, T, D = key.shape
    g, r = query.shape[1] // H, query.shape[2]
    freq, steps, run, cos, sin = _angle_state(a, b, inv_freq)
    rotated = np.empty((CHUNK, D), np.float32)
    for j0 in range(0, far, CHUNK):
        rows = min(CHUNK, far - j0)
        _fill(j0, rows, a, b, G, 0.0, freq, steps, run, cos, sin)
        for bb in range(B):
            for h in range(H):
                for t in range(rows):
                    _rotate_row(key[bb, h, j0 + t], rotated[t], cos[t], sin[t])
                for e in range(g * h, g * h + g):
                    for s in range(r):
                        split = min(max(rows_at[s] - window + 1 - j0, 0), rows)  # rows t < split: far pairs
                        q, o = q_far[bb, e, s], out[bb, e, s]
                        for t in range(split):
                            o[j0 + t] = scaling * _dot(q, rotated[t])
                        q = query[bb, e, s]
                        for t in range(split, rows):
                            o[j0 + t] = scaling * _dot(q, key[bb, h, j0 + t])
    for bb in range(B):
        for h in range(H):
            for e in range(g * h, g * h + g):
                for s in range(r):
                    q, o = query[bb, e, s], out[bb, e, s]
                    for j in range(far, T):
                        o[j] = scaling * _dot(q, key[bb, h, j])
