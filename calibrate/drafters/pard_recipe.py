"""PARD's training layout: one causal LM forward that trains every draft position at once.

A PARD drafter (``calibrate.drafters.parallel``) drafts ``K`` tokens from one forward over the last
committed token ``x_a`` and ``K - 1`` copies of its mask token at positions ``a + 1 .. a + K - 1``:
row ``c`` (``c = 0`` the real token, ``c >= 1`` mask ``c``) guesses ``x_{a + c + 1}``. PARD
(AMD-AGI/PARD, arXiv:2504.18583) trains all of those rows of a sequence ``x_0 .. x_{L-1}`` in one
forward: the real tokens, then ``C - 1`` copies of the sequence made of mask tokens (``C`` copies in
all, ``C >= K``), every copy at positions ``0 .. L - 1``. The row of copy ``c`` at position ``t``
stands for mask ``c`` after anchor ``a = t - c``, so it must see exactly what that mask sees at
inference:

* the real tokens ``x_0 .. x_a`` (copy 0, positions up to the anchor), and
* the masks of the same anchor before it: copy ``c'`` at position ``a + c'`` for ``1 <= c' <= c``
  (itself included),

and it is trained on ``x_{a + c + 1}`` (copy 0's rows are the plain next-token rows). :func:`pard_rows`
builds that layout; :func:`visible` is its attention rule.

**Conditional drop** (PARD's COD) keeps every real row but only a fraction ``max(r^c, r_min)`` of the
anchors in copy ``c``, each drawn among those kept in copy ``c - 1``: a kept mask row always has the
masks of its anchor before it, so what it sees is still what it would see at inference, and the
forward shrinks from ``C L`` rows to about ``L (1 + r + r^2 + ...)``. PARD's defaults: ``C = 8``,
``r = 0.7``, ``r_min = 0.2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PardRows", "pard_rows", "visible", "kept_anchors"]

IGNORE = -100  # target of a row that guesses past the sequence (cross_entropy's ignore_index)


@dataclass
class PardRows:
    """One sequence's training rows in PARD's layout (each tensor has one entry per row)."""

    input_ids: torch.Tensor  # (R,): x_t for copy 0, the mask token for the others
    position_ids: torch.Tensor  # (R,): t
    copy: torch.Tensor  # (R,): c
    targets: torch.Tensor  # (R,): x_{t + 1}, or IGNORE past the sequence

    @property
    def anchor(self) -> torch.Tensor:
        """The last real position each row sees: ``t - c``."""
        return self.position_ids - self.copy

    def mask(self) -> torch.Tensor:
        """The (1, 1, R, R) bool attention mask of :func:`visible` (True: the key is seen)."""
        return visible(self.copy, self.anchor)[None, None]


def visible(copy: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """(R, R) bool: row ``r`` sees key ``s`` when ``s`` is a real token at or before ``r``'s anchor, or a
    mask of ``r``'s anchor no later than ``r`` (module docstring)."""
    c_q, a_q = copy[:, None], anchor[:, None]
    c_k, a_k = copy[None, :], anchor[None, :]
    real = (c_k == 0) & (a_k <= a_q)  # copy 0's anchor is its position
    same_anchor_mask = (c_k >= 1) & (c_k <= c_q) & (a_k == a_q)
    return real | same_anchor_mask


def kept_anchors(length: int, copies: int, ratio: float, minimum: float, generator: torch.Generator | None
                 ) -> list[torch.Tensor]:
    """The anchors kept in each copy ``c >= 1`` (sorted): at most ``int(L max(ratio^c, minimum))`` of them,
    drawn among copy ``c - 1``'s that leave row ``c`` a target inside the sequence; ratio 1 keeps them all."""
    kept = []
    previous = torch.arange(length)  # copy 0: every position
    for c in range(1, copies):
        valid = previous[previous <= length - 2 - c]  # row c guesses x_{a + c + 1}: inside the sequence
        if ratio >= 1:
            chosen = valid
        else:
            n = min(len(valid), int(length * max(ratio ** c, minimum)))
            chosen = valid[torch.randperm(len(valid), generator=generator)[:n]]
        chosen = chosen.sort().values
        kept.append(chosen)
        previous = chosen
    return kept


def pard_rows(ids: torch.Tensor, copies: int, mask_token: int, ratio: float = 1.0, minimum: float = 0.0,
              generator: torch.Generator | None = None) -> PardRows:
    """PARD's rows for the token sequence ``ids`` (L,): copy 0 (every position), then ``copies - 1``
    mask copies with conditional drop (``ratio``, ``minimum``; ratio 1: no drop)."""
    ids = torch.as_tensor(ids).long()
    L = ids.shape[0]
    positions = [torch.arange(L)]
    copy = [torch.zeros(L, dtype=torch.long)]
    for c, anchors in enumerate(kept_anchors(L, copies, ratio, minimum, generator), start=1):
        positions.append(anchors + c)
        copy.append(torch.full_like(anchors, c))
    position_ids, copy = torch.cat(positions), torch.cat(copy)
    input_ids = torch.where(copy == 0, ids[position_ids], torch.full_like(position_ids, mask_token))
    nxt = position_ids + 1
    targets = torch.where(nxt < L, ids[nxt.clamp(max=L - 1)], torch.full_like(nxt, IGNORE))
    return PardRows(input_ids, position_ids, copy, targets)

