"""A decoding step's far keys rotated in one pass on the CPU: each key read once and written rotated.

:func:`sharpdraft_runtime.positions.decode_keys` rotates every far key of a one-row step by its own
shift. In torch's elementwise ops that is a cos and sin table of the far keys (angle addition from
two small tables, a dozen calls) and four passes over the keys, each a kernel launch and a sweep of
the cache; on a drafter with one layer (an EAGLE-3 head) that cost about a fifth of the whole
drafting step. Here it is one compiled loop (numba) over the far key rows: row ``j``'s cos and sin
come from row ``j - 1``'s by angle addition in float64 (exact angles every ``ANCHOR`` rows), and the
rows are rotated as they are copied; the neighbour keys are copied as they are.

Key ``j``'s shift is ``a j + b (j // G) + c`` (:func:`positions._decode_law`: clamp, group and pi all
have that form for one query row), so a step from row to row is one of two fixed rotations.

Used for float32 tensors on the CPU that need no gradient; anything else (CUDA, half precision,
autograd), a Python without numba, or numba told to compile nothing (``NUMBA_DISABLE_JIT=1``), takes
the torch path, which computes the same rotation (tested against each other and against float64).
Nothing outlives a call: no table, no buffer.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["available", "usable", "rotate_far_keys"]

_KERNEL = None  # the compiled kernel; False when numba cannot be imported
ANCHOR = 128  # rows between exact angles: the running product's rounding (~1e-16 a row) never builds up


def _compile():
    """The kernel, compiled on first use (numba's on-disk cache makes later processes fast); False without numba."""
    try:
        import numba
    except ImportError:  # the torch path serves
        return False
    if numba.config.DISABLE_JIT:  # NUMBA_DISABLE_JIT=1 would run the loop in Python, far slower than torch's path
        return False

    @numba.njit(cache=True, nogil=True)
    def rotate(key, out, far, a, b, G, c, inv_freq):
        """``out``: ``key``'s rows ``j < far`` rotated by the angles ``(a j + b (j // G) + c) inv_freq``, the rest
        copied; the angles in float64 whatever ``inv_freq``'s precision (float32 values are exact in float64)."""
        B, H, T, D = key.shape
        freq = inv_freq.astype(np.float64)
        half = freq.shape[0]
        cos, sin = np.empty(half), np.empty(half)  # the running angle of row j, float64
        step_cos, step_sin = np.cos(a * freq), np.sin(a * freq)  # row j - 1 to j
        jump_cos, jump_sin = np.cos((a + b) * freq), np.sin((a + b) * freq)  # the same where j // G grows
        c32, s32 = np.empty(half, np.float32), np.empty(half, np.float32)
        for j in range(far):
            if j % ANCHOR == 0:
                angle = (a * j + b * (j // G) + c) * freq  # exact shifts (integers or dyadic) in float64
                cos[:], sin[:] = np.cos(angle), np.sin(angle)
            else:
                jumps = b != 0.0 and j % G == 0
                for p in range(half):  # (cos, sin) times the step: angle addition
                    dc, ds = (jump_cos[p], jump_sin[p]) if jumps else (step_cos[p], step_sin[p])
                    cos[p], sin[p] = cos[p] * dc - sin[p] * ds, sin[p] * dc + cos[p] * ds
            for p in range(half):
                c32[p], s32[p] = cos[p], sin[p]
            for bb in range(B):
                for h in range(H):
                    x, y = key[bb, h, j], out[bb, h, j]
                    for p in range(half):  # rotate-half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
                        x1, x2 = x[p], x[p + half]
                        y[p] = x1 * c32[p] - x2 * s32[p]
                        y[p + half] = x2 * c32[p] + x1 * s32[p]
                    for p in range(2 * half, D):  # partial rotary: the rest is not rotated
                        y[p] = x[p]
        for bb in range(B):
            for h in range(H):
                out[bb, h, far:] = key[bb, h, far:]

    return rotate


def available() -> bool:
    """Whether the compiled kernel can be used here (numba importable). numba compiles it at its first call (about
    a second) and keeps it on disk, so later processes load it."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _compile()
    return _KERNEL is not False


def usable(key: torch.Tensor) -> bool:
    """Whether :func:`rotate_far_keys` serves ``key``: float32 on the CPU, no gradient, and the kernel here."""
    return (key.device.type == "cpu" and key.dtype == torch.float32 and not key.requires_grad
            and key.dim() == 4 and available())


def rotate_far_keys(key: torch.Tensor, far: int, law: tuple[float, float, int, float], inv_freq: torch.Tensor
                    ) -> torch.Tensor:
    """A new tensor: ``key`` (B, kv_heads, k_len, D; :func:`usable`) with rows ``j < far`` rotated by the shift
    ``a j + b (j // G) + c`` (``law = (a, b, G, c)``, positions) at the RoPE frequencies ``inv_freq`` (R/2,),
    the rest copied."""
    out = torch.empty(key.shape, dtype=key.dtype)
    a, b, G, c = law
    _KERNEL(key.numpy(), out.numpy(), far, float(a), float(b), int(G), float(c), inv_freq.detach().cpu().numpy())
    return out
