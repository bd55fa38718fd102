"""A decoding step's far keys (and a block's), rotated in one compiled pass on the CPU.

A decoding step's far key ``j`` is rotated by its own shift ``a j + b (j // G) + c``
(:func:`positions._decode_law`: clamp, group and pi all have that form for one query row). In torch's
elementwise ops that is a cos and sin table over the far keys (angle addition from two small tables, a
dozen calls) and four passes over the keys; on a drafter with one layer (an EAGLE-3 head) that cost
about a fifth of the whole drafting step. Here it is one compiled loop (numba, :mod:`._kernels`) over
the far key rows, their cos and sin formed by angle addition a few rows at a time:

* :func:`rotate_far_keys` writes the rotated keys (a new tensor) for the caller's own kernel to attend;
* :func:`decode_logits` writes only the logits: each far key is rotated in registers and dotted with the
  query heads that share it, so no copy of the keys is written or read again;
* :func:`block_logits` does the same for a block of query rows (a DFlash block): each key read once, a far
  one rotated in registers and dotted with every row and query head that share it, a near one (the pair
  inside the neighbour window) dotted as it is.

Used for float32 tensors on the CPU that need no gradient; anything else (CUDA, half precision,
autograd), a Python without numba, or numba told to compile nothing (``NUMBA_DISABLE_JIT=1``), takes
the torch path, which computes the same rotation (tested against each other and against float64).
Nothing outlives a call: no table, no buffer.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["available", "usable", "rotate_far_keys", "decode_logits", "block_logits"]

_KERNELS = None  # the compiled kernels' module; False when numba cannot be imported or compiles nothing


def available() -> bool:
    """Whether the compiled kernels can be used here (numba importable and compiling). numba compiles each at its
    first call (about a second) and keeps it on disk, so later processes load it."""
    global _KERNELS
    if _KERNELS is None:
        try:
            import numba
        except ImportError:  # the torch path serves
            _KERNELS = False
        else:  # NUMBA_DISABLE_JIT=1 would run the loops in Python, far slower than torch's path
            if numba.config.DISABLE_JIT:
                _KERNELS = False
            else:
                from . import _kernels
                _KERNELS = _kernels
    return _KERNELS is not False


def usable(key: torch.Tensor) -> bool:
    """Whether the compiled kernels serve ``key``: float32 on the CPU, no gradient, and the kernels here."""
    return (key.device.type == "cpu" and key.dtype == torch.float32 and not key.requires_grad
            and key.dim() == 4 and available())


def rotate_far_keys(key: torch.Tensor, far: int, law: tuple[float, float, int, float], inv_freq: torch.Tensor
                    ) -> torch.Tensor:
    """A new tensor: ``key`` (B, kv_heads, k_len, D; :func:`usable`) with rows ``j < far`` rotated by the shift
    ``a j + b (j // G) + c`` (``law = (a, b, G, c)``, positions) at the RoPE frequencies ``inv_freq`` (R/2,),
    the rest copied."""
    out = torch.empty(key.shape, dtype=key.dtype)
    a, b, G, c = law
    _KERNELS.rotate_far(key.numpy(), out.numpy(), far, float(a), float(b), int(G), float(c), _freq(inv_freq))
    return out


def decode_logits(query: torch.Tensor, key: torch.Tensor, far: int, law: tuple[float, float, int, float],
                  inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """The logits ``scaling * q . k`` (B, heads, 1, k_len), float32, of a decoding step's ``query`` (B, heads, 1, D),
    float32 on the CPU, against ``key`` (:func:`usable`) with its rows ``j < far`` rotated as
    :func:`rotate_far_keys` rotates them. Query head ``h`` reads key head ``h // (heads / kv_heads)`` (GQA, as
    ``repeat_kv`` pairs them)."""
    logits = torch.empty((query.shape[0], query.shape[1], 1, key.shape[2]), dtype=torch.float32)
    a, b, G, c = law
    _KERNELS.far_logits(query.detach().numpy(), key.numpy(), logits.numpy(), far, float(a), float(b), int(G), float(c),
                        _freq(inv_freq), float(scaling))
    return logits


def block_logits(query: torch.Tensor, q_far: torch.Tensor, key: torch.Tensor, rows_at, window: int | None, far: int,
                 law: tuple[float, float, int], inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """The logits ``scaling * q . k`` (B, heads, r, k_len), float32, of a block's query rows at positions ``rows_at``
    (r,), integers, against ``key`` (:func:`usable`) at slots ``0 .. k_len - 1``, in one pass over the keys: a pair
    with ``i - j < window`` (near; None: no pair is) dots ``query`` (B, heads, r, D) with the key as it is, any other
    dots ``q_far`` (the rows rotated to their far positions) with key ``j`` rotated by ``a j + b (j // G)``
    (``law = (a, b, G)``), a few keys at a time in a buffer of the first-level cache. Keys from ``far`` on must be
    near for every row. GQA as in :func:`decode_logits`."""
    B, heads, r, _ = query.shape
    logits = torch.empty((B, heads, r, key.shape[2]), dtype=torch.float32)
    a, b, G = law
    rows_at = np.ascontiguousarray(rows_at, dtype=np.int64)
    # None: a window no pair is within (i - j > min(i) - k_len for every row i and key j < k_len)
    near_below = int(rows_at.min()) - key.shape[2] if window is None else int(window)
    _KERNELS.block_logits(query.detach().contiguous().numpy(), q_far.detach().contiguous().numpy(), key.numpy(),
                          rows_at, near_below, logits.numpy(), far, float(a), float(b), int(G), _freq(inv_freq),
                          float(scaling))
    return logits


def _freq(inv_freq: torch.Tensor):
    """``inv_freq`` as the kernels take it: a numpy array on the host."""
    return inv_freq.detach().cpu().numpy()
