"""PARD's parallel drafting in the one speculative loop: K drafts from one causal forward.

A PARD drafter (AMD-AGI/PARD, ``pard/pard_infer.py``) is a causal LM trained to read ``K - 1``
copies of a reserved token (config ``pard_token``) after the text: in **one** forward over the
pending token ``x_N`` and ``K - 1`` mask tokens, the logits at the pending token guess ``x_{N+1}``
and those at mask ``j`` guess ``x_{N+1+j}``. The drafter keeps its own KV cache over the committed
text; the mask tokens' entries are dropped as soon as the drafts are read, and the tokens the target
commits (accepted drafts, then its own) are fed as themselves on the next draft, so the cache only
ever holds real tokens at their true positions.

:class:`PardParallelProposer` is that proposer behind the ``BlockProposer`` protocol
(``calibrate.drafters.base``), on the cache it shares with ``hf``'s chain (``calibrate.drafters.causal``),
so ``calibrate.speculative.speculative_generate`` verifies it as it does a chain or a DFlash block (greedy, or speculative sampling: each draft drawn from its own
row's law, which does not depend on the other drafts' draws). A spec is applied as in the
teacher-forced pass, through the attention tap (``calibrate.taps``): the scale, a window and sinks,
and the distance fixes.
"""

from __future__ import annotations

import numpy as np
import torch

from sharpdraft_theory import ScaleSpec

from .base import pick_rows
from .causal import CachedCausalLM

__all__ = ["PardParallelProposer"]


class PardParallelProposer(CachedCausalLM):
    """Parallel drafting with a PARD causal LM (module docstring; a ``BlockProposer``). ``forwards`` counts
    its forwards (one per draft, after the prompt's prefill)."""

    name = "pard"

    def __init__(self, model, pard_token: int, spec: ScaleSpec | None = None):
        super().__init__(model, spec)
        self.pard_token = int(pard_token)

    def draft_logits(self, k: int) -> torch.Tensor:
        """The logits (k, vocab) of one forward over the unfed committed tokens and ``k - 1`` mask tokens,
        row ``j`` guessing token ``N + 1 + j``; the masks' cache entries are dropped again."""
        from ..speculative import crop_cache

        kept = self.cache.get_seq_length() + len(self.unfed)  # real tokens once these are fed
        logits = self._forward(self.unfed + [self.pard_token] * (k - 1), k)  # (k, vocab)
        self.forwards += 1
        crop_cache(self.cache, kept)
        self.unfed = []
        return logits

    def propose(self, k: int, rule) -> tuple[list[int], np.ndarray | None]:
        """``k`` drafts from one forward (:meth:`draft_logits`), row ``j`` picked by ``rule`` from its own logits."""
        return pick_rows(self.draft_logits(k), rule)
