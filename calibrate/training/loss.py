"""The one distillation loss: a drafter's law pulled toward the target's, row by row.

Every trainer here and online adaptation (``calibrate.online``) descend it. It is the cross-entropy
from the teacher's law ``p`` to the drafter's ``q = softmax(logits)``, ``-sum_v p(v) log q(v)``: the
forward KL divergence ``KL(p || q)`` plus the teacher's entropy, which the drafter cannot change, so
both have the same gradient (bit for bit: autograd reaches ``log q`` through ``-p`` either way).
"""

from __future__ import annotations

import torch

__all__ = ["distillation_loss"]


def distillation_loss(logits: torch.Tensor, teacher: torch.Tensor, tokens: torch.Tensor | None = None,
                      reduction: str = "none") -> torch.Tensor:
    """``-sum_v p(v) log softmax(logits)(v)`` per row, shape ``logits.shape[:-1]``; summed over every row
    too with ``reduction="sum"`` (one sum over all terms, as ``cross_entropy``'s ``reduction="sum"``).

    Parameters
    ----------
    logits : Tensor (..., V)
        The drafter's logits (cast them to float32 first for a float32 loss under autocast).
    teacher : Tensor (..., V), or (..., K) with ``tokens``
        The teacher's probabilities: over the whole vocabulary, or over ``K`` tokens per row (a
        top-K law, renormalised).
    tokens : LongTensor (..., K), optional
        The vocabulary ids of ``teacher``'s columns.

    >>> float(distillation_loss(torch.zeros(1, 4), torch.full((1, 4), 0.25))[0])  # log 4
    1.3862943649291992
    """
    if reduction not in ("none", "sum"):
        raise ValueError(f"reduction {reduction!r}: expected 'none' or 'sum'")
    log_q = logits.log_softmax(-1)
    if tokens is not None:
        log_q = log_q.gather(-1, tokens)
    return -(teacher * log_q).sum(-1) if reduction == "none" else -(teacher * log_q).sum()
