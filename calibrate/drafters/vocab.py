"""Draft vocabularies: the target ids a head drafts from, stored as EAGLE-3's ``d2t`` map.

A head whose output covers only the ``size`` most frequent tokens of its training text runs a twelfth of
SmolLM2's 49,152-row output head (4,096 rows) per drafted row, and a greedy draft changes only where
the whole vocabulary's argmax lies outside them. Row ``i`` of the draft vocabulary is target id
``i + d2t[i]`` (ids sorted), as EAGLE-3 writes it.
"""

from __future__ import annotations

import torch

__all__ = ["d2t_of", "draft_vocabulary"]


def draft_vocabulary(tokens: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``tokens`` (ties: lower id first), sorted by id.

    >>> draft_vocabulary(torch.tensor([5, 5, 2, 7, 7, 7, 1]), 8, 2).tolist()
    [5, 7]
    >>> draft_vocabulary(torch.tensor([3, 1]), 4, 3).tolist()  # a tie among unseen ids: the lowest
    [0, 1, 3]
    """
    counts = torch.bincount(tokens.flatten(), minlength=vocab_size).double()
    counts -= torch.arange(vocab_size, dtype=torch.float64) * 1e-9  # deterministic tie break
    return torch.sort(torch.topk(counts, size).indices).values


def d2t_of(ids: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's offsets of sorted target ``ids``: ``d2t[i] = ids[i] - i``."""
    return ids - torch.arange(len(ids), device=ids.device)
