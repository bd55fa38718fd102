"""A causal LM drafting in the one speculative loop, one token per forward (``--drafter hf``).

The drafter keeps its own KV cache over the committed text, and drafts a chain: each forward feeds
the token drafted before it (the first feeds the committed tokens the cache lacks) and picks the
next by the loop's rule (greedy, or a draw from its law for speculative sampling). At
:meth:`CachedCausalLM.commit` the drafts' rows are dropped and the target's tokens (the accepted
drafts, then its own) wait to be fed as themselves with the next draft, so the cache only ever
holds committed tokens at their true positions. A spec is applied as in the teacher-forced pass,
through the attention tap (``calibrate.taps``): the scale, a window and sinks, and the distance fixes.

:class:`CachedCausalLM` is the cache both causal-LM proposers share: :class:`CausalLMProposer` here
and PARD's parallel drafts (``calibrate.drafters.parallel``).
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from sharpdraft_theory import ScaleSpec

__all__ = ["CachedCausalLM", "CausalLMProposer"]


class CachedCausalLM:
    """A causal LM's KV cache over the committed text ``x_0 .. x_N`` (module docstring); ``forwards``
    counts its forwards after the prompt's prefill."""

    feature_ids = None  # reads no target features

    def __init__(self, model, spec: ScaleSpec | None = None):
        self.model, self.spec = model, spec
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

    def commit(self, new: list[int], features) -> None:
        """The target accepted ``new`` (accepted drafts, then its own token): fed as themselves next time."""
        self.unfed = self.unfed + list(new)


class CausalLMProposer(CachedCausalLM):
    """Chain drafting with a causal LM of the target's vocabulary (module docstring): ``k`` forwards
    of one new token each. A ``ChainProposer`` (``calibrate.drafters.base``), so a copy pointer can wrap it."""

    name = "hf"
    sliding_window = None  # the spec's window is applied through the tap

    def __init__(self, model, spec: ScaleSpec | None = None):
        super().__init__(model, spec)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.columns = torch.arange(self.vocab_size, device=model.get_input_embeddings().weight.device)
        self.kept = None  # committed tokens in the cache while a step's drafts follow them

    def row_logits(self, drafted: list[int]) -> torch.Tensor:
        """The logits (vocab,) after the pending token and ``drafted``: a step's first call feeds the committed
        tokens the cache lacks, each later one the draft before it."""
        if not drafted:
            self.kept = self.cache.get_seq_length() + len(self.unfed)
            ids, self.unfed = self.unfed, []
        else:
            ids = [drafted[-1]]
        self.forwards += 1
        return self._forward(ids, 1)[0]

    def propose(self, k: int, rule) -> tuple[list[int], np.ndarray | None]:
        """``k`` drafts, each picked by ``rule`` after the ones before it, and their laws (None: greedy)."""
        drafts, laws = [], []
        for _ in range(k):
            token, law = rule.pick(self.row_logits(drafts))
            drafts.append(int(token))
            if law is not None:
                laws.append(law)
        return drafts, (np.stack(laws) if laws else None)

    def commit(self, new: list[int], features) -> None:
        """The drafts' rows go from the cache (the accepted ones are fed again, as themselves, with ``new``)."""
        from ..speculative import crop_cache

        if self.kept is not None:
            crop_cache(self.cache, self.kept)
            self.kept = None
        super().commit(new, features)
