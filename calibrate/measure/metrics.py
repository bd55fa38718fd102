"""Per-row draft quality against the target: greedy agreement and the expected acceptance of sampling.

Speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318)
accepts a token drafted from ``q`` with probability ``min(1, p(x) / q(x))``, so a drafted token is
accepted with probability

    beta_T = sum_x min(p_T(x), q_T(x)),     p_T = softmax(target logits / T), q_T = softmax(draft logits / T)

(one minus the total variation distance between the two laws). Greedy top-1 agreement is its
``T -> 0`` limit (for distinct maxima). A drafter that drafts from a sub-vocabulary (EAGLE-3's
``d2t``) has ``q = 0`` outside it, so only its columns of ``p`` count, while ``p`` is normalised
over the whole target vocabulary.
"""

from __future__ import annotations

import torch

__all__ = ["NextTokenLaw", "expected_acceptance"]

_CHUNK = 1024  # rows per chunk: (chunk, vocab) temporaries, never (rows, vocab) twice


class NextTokenLaw:
    """The target's next-token law at temperature ``T`` over the columns a drafter can draft.

    Parameters
    ----------
    target_logits : Tensor, shape (rows, vocab)
        The target's next-token logits, one row per drafter row.
    temperature : float
        ``T > 0``.
    columns : LongTensor, shape (draft_vocab,), optional
        Target ids of the drafter's logit columns, in column order (None: column ``i`` is id ``i``).
    points : LongTensor, shape (rows,), optional
        One target id per row drafted as a point mass (prompt lookup), -1 where none is.

    Attributes
    ----------
    greedy : LongTensor, shape (rows,)
        The target's greedy token per row.
    point_accept : Tensor, shape (rows,), or None
        With ``points``: ``p_T(x)`` of each row's point (``sum_x min(p_T, q)`` for ``q`` a point mass
        at ``x``, over the whole target vocabulary), 0 where there is none.
    """

    def __init__(self, target_logits: torch.Tensor, temperature: float, columns: torch.Tensor | None = None,
                 points: torch.Tensor | None = None):
        self.temperature = float(temperature)
        self.greedy = target_logits.argmax(-1)
        rows = target_logits.shape[0]
        width = target_logits.shape[1] if columns is None else len(columns)
        self.log_p = torch.empty(rows, width, dtype=torch.float32, device=target_logits.device)  # (rows, columns)
        self.point_accept = None
        if points is not None:
            points = points.to(target_logits.device)
            self.point_accept = torch.zeros(rows, dtype=torch.float32, device=target_logits.device)  # (rows,)
        for a in range(0, rows, _CHUNK):
            scaled = target_logits[a:a + _CHUNK].float() / self.temperature  # (c, vocab)
            picked = scaled if columns is None else scaled[:, columns]  # (c, columns)
            log_z = torch.logsumexp(scaled, dim=-1, keepdim=True)  # (c, 1)
            self.log_p[a:a + _CHUNK] = picked - log_z
            if points is not None:
                x = points[a:a + _CHUNK]  # (c,)
                p = (scaled.gather(1, x.clamp(min=0)[:, None]) - log_z).exp()[:, 0]  # (c,)
                self.point_accept[a:a + _CHUNK] = torch.where(x >= 0, p, torch.zeros_like(p))

    def acceptance(self, draft_logits: torch.Tensor, start: int = 0) -> torch.Tensor:
        """``sum_x min(p_T(x), q_T(x))`` per row (float32): ``draft_logits`` (rows, columns) -> (rows,),
        its rows the law's rows ``start .. start + rows - 1``.

        ``draft_logits`` may hold fewer columns than the law (a drafter whose vocabulary is a prefix
        of the target's): the missing ones have ``q = 0``.
        """
        out = torch.empty(draft_logits.shape[0], dtype=torch.float32, device=draft_logits.device)
        width = draft_logits.shape[1]
        for a in range(0, draft_logits.shape[0], _CHUNK):
            log_q = torch.log_softmax(draft_logits[a:a + _CHUNK].float() / self.temperature, dim=-1)  # (c, columns)
            log_p = self.log_p[start + a:start + a + len(log_q), :width]  # (c, columns)
            out[a:a + _CHUNK] = torch.minimum(log_p, log_q).exp().sum(-1)
        return out


def expected_acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float,
                        columns: torch.Tensor | None = None) -> torch.Tensor:
    """One-shot :meth:`NextTokenLaw.acceptance`: ``(rows, vocab)``, ``(rows, columns)`` -> ``(rows,)``.

    Examples
    --------
    >>> p = torch.tensor([[2.0, 0.0, 0.0]]); q = torch.tensor([[0.0, 2.0, 0.0]])
    >>> round(float(expected_acceptance(p, p, 1.0)), 6)
    1.0
    >>> round(float(expected_acceptance(p, q, 100.0)), 3)  # near-uniform laws at a high temperature
    0.993
    """
    return NextTokenLaw(target_logits, temperature, columns).acceptance(draft_logits)
