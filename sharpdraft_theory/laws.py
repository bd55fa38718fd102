"""Query-scaling laws ``alpha(n)``, vectorised over the number of visible keys ``n``.

=============  =========================================================  ======================
law            alpha(n)                                                   parameters
=============  =========================================================  ======================
log-linear     1 for n <= n_ref, else 1 + slope ln(n / n_ref) (SharpDraft)  n_ref, slope
qwen-logn      max(1, ln n / ln n_ref) (Qwen "LogN" attention scaling)     n_ref
llama4         1 + slope ln(floor(n / n_ref) + 1) (Llama 4 temperature     n_ref = floor_scale,
               tuning, applied to the query)                               slope = attn_scale
ssmax          slope ln n (Scalable-Softmax, no reference length)          slope = s
constant       1 + slope for every n                                       slope
=============  =========================================================  ======================

Every law is then capped at ``alpha_max`` when one is given. Qwen's LogN law is the log-linear law
with ``slope = 1 / ln n_ref``: ``1 + ln(n / n_ref) / ln n_ref = ln n / ln n_ref``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["LAWS", "alpha_law"]

LAWS = ("log-linear", "qwen-logn", "llama4", "ssmax", "constant")


def alpha_law(law: str, n, *, n_ref: int | None = None, slope=None, alpha_max: float | None = None) -> np.ndarray:
    """Query scale ``alpha(n)`` for ``law``; ``n`` and ``slope`` broadcast together.

    Examples
    --------
    >>> alpha_law("log-linear", [256, 512, 1024], n_ref=512, slope=0.25).tolist()
    [1.0, 1.0, 1.1732867951399863]
    >>> alpha_law("qwen-logn", [4096], n_ref=64).tolist()
    [2.0]
    """
    n = np.asarray(n, dtype=np.float64)
    if law in ("log-linear", "qwen-logn", "llama4") and n_ref is None:
        raise ValueError(f"law {law!r} needs n_ref")
    if law in ("log-linear", "llama4", "ssmax", "constant") and slope is None:
        raise ValueError(f"law {law!r} needs a slope")
    if law == "log-linear":
        s = np.asarray(slope, dtype=np.float64)
        alpha = 1.0 + s * np.log(np.maximum(n, n_ref) / n_ref)
    elif law == "qwen-logn":
        alpha = np.maximum(1.0, np.log(np.maximum(n, 1.0)) / np.log(n_ref))
    elif law == "llama4":
        alpha = 1.0 + np.asarray(slope, dtype=np.float64) * np.log(np.floor(n / n_ref) + 1.0)
    elif law == "ssmax":
        alpha = np.asarray(slope, dtype=np.float64) * np.log(np.maximum(n, 1.0))
    elif law == "constant":
        alpha = np.broadcast_to(1.0 + np.asarray(slope, dtype=np.float64), np.broadcast_shapes(n.shape, np.shape(slope)))
    else:
        raise ValueError(f"unknown law {law!r}; choose one of {', '.join(LAWS)}")
    if alpha_max is not None:
        alpha = np.minimum(alpha, alpha_max)
    return np.asarray(alpha, dtype=np.float64)
