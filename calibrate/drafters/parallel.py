"""PARD's parallel drafting in the one speculative loop: K drafts from one causal forward.

A PARD drafter (AMD-AGI/PARD, ``pard/pard_infer.py``) is a causal LM trained to read ``K - 1``
copies of a reserved token (config ``pard_token``) after the text: in **one** forward over the
pending token ``x_N`` and ``K - 1`` mask tokens, the logits at the pending token guess ``x_{N+1}``
and those at mask ``j`` guess ``x_{N+1+j}``. The drafter keeps its own KV cache over the committed
text; the mask tokens' entries are dropped as soon as the drafts are read, and the tokens the target
commits (accepted drafts, then its own) are fed as themselves on the next draft, so the cache only
ever holds real tokens at their true positions.

:class:`PardParallelDrafter` is that proposer behind the ``ChainDrafter`` protocol
(``calibrate.drafters.base``), so ``calibrate.speculative.speculative_generate`` verifies it as it
does a chain or a DFlash block (greedy, or speculative sampling: each draft drawn from its own
row's law, which does not depend on the other drafts' draws). A spec is applied as in the
teacher-forced pass, through the attention tap (``calibrate.taps``): the scale, a window and sinks,
and the distance fixes.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from sharpdraft_theory import ScaleSpec

__all__ = ["PardParallelDrafter"]


class PardParallelDrafter:
    """Parallel drafting with a PARD causal LM (module docstring). ``forwards`` counts its forwards
    (one per draft, after the prompt's prefill)."""

    name = "pard"
    feature_ids = None  # reads no target features

    def __init__(self, model, pard_token: int, spec: ScaleSpec | None = None, pointer=None):
        self.model, self.pard_token, self.spec = model, int(pard_token), spec
        self.pointer = pointer  # a copy pointer mixed into every row (calibrate.drafters.pointer), or None
        self.tokens: list[int] = []  # x_0 .. x_N, read by the pointer
        self.forwards = 0
        # transformers' causal LMs take logits_to_keep; a model that does not computes every row's logits
        self._keeps = "logits_to_keep" in inspect.signature(model.forward).parameters

    def close(self) -> None:
        """Nothing to undo: the spec is applied per forward."""

    def _forward(self, ids: list[int], keep: int) -> torch.Tensor:
        """Feed ``ids`` after the cache; the logits (keep, vocab) of the last ``keep`` of them: only those
        rows go through the output head, the drafter's largest matrix."""
        from ..speculative import cached_forward
        from ..taps import ScalingTap, attention_tap

        device = self.model.get_input_embeddings().weight.device
        extra = {"logits_to_keep": keep} if self._keeps else {}
        with attention_tap(self.model, ScalingTap(self.spec), restrict=self.spec):
            out = cached_forward(self.model, torch.tensor([ids], device=device), self.cache, **extra)
        return out.logits[0, -keep:].float()

    def start(self, prompt: torch.Tensor, features, pending: int) -> None:
        """Prefill the drafter's cache with ``prompt`` (1, N); ``x_N = pending`` is fed with the first draft."""
        from ..speculative import new_cache

        self.cache = new_cache()
        self._forward(prompt[0].tolist(), 1)
        self.unfed = [pending]  # committed tokens not in the cache yet
        self.tokens = prompt[0].tolist() + [int(pending)]

    def draft_logits(self, k: int) -> torch.Tensor:
        """The logits (k, vocab) of one forward over the unfed committed tokens and ``k - 1`` mask tokens,
        row ``j`` guessing token ``N + 1 + j``; the masks' cache entries are dropped again."""
        from ..speculative import crop_cache

        kept = self.cache.get_seq_length() + len(self.unfed)  # real tokens once these are fed
        logits = self._forward(self.unfed + [self.pard_token] * (k - 1), k)  # (k, vocab)
        self.forwards += 1
        crop_cache(self.cache, kept)
        self.unfed = []
        if self.pointer is not None:
            from .pointer import spec_block_mix

            return spec_block_mix(self.pointer, logits, torch.tensor(self.tokens, device=logits.device), self.spec)
        return logits

    def draft(self, k: int, rule) -> tuple[list[int], np.ndarray | None]:
        """``k`` drafts from one forward (:meth:`draft_logits`), row ``j`` picked by ``rule`` from its own logits."""
        logits = self.draft_logits(k)
        drafts, laws = [], []
        for j in range(k):
            token, law = rule.pick(logits[j])
            drafts.append(int(token))
            if law is not None:
                laws.append(law)
        return drafts, (np.stack(laws) if laws else None)

    def commit(self, new: list[int], features) -> None:
        """The target accepted ``new`` (accepted drafts, then its own token): fed as themselves next time."""
        self.unfed = self.unfed + list(new)
        self.tokens.extend(int(x) for x in new)
