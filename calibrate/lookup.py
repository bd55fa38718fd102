"""Prompt lookup: drafts copied from the context itself, the training-free drafter users reach for first.

Prompt lookup decoding (Saxena 2023, github.com/apoorvumang/prompt-lookup-decoding; vLLM's ``ngram``
method is the same drafter), with the match rule transformers runs
(``generate(prompt_lookup_num_tokens=K)``, ``PromptLookupCandidateGenerator``): for ``m`` from
``max_ngram`` down to ``min_ngram``, find the
**first** (leftmost) earlier place where the context's last ``m`` tokens occur with at least one
token after them; the draft is the up to ``K`` tokens that followed there (never past the end of
the context), cut before the first end-of-sequence token. The longest ``m`` that occurs wins, and
once it occurs the search stops, even if its draft is empty (a continuation that starts with the
end-of-sequence token drafts nothing, as in transformers). No match: no draft, and the step is
plain decoding. transformers' defaults are ``max_ngram = 2`` (``max_matching_ngram_size``, when
the generation config leaves it unset) and ``min_ngram = 1``; these are the defaults here.

One definition serves every use: :class:`PromptLookup` indexes a growing token sequence (the
first place of every ``m``-gram, so a proposal costs ``max_ngram`` dictionary look-ups); the
teacher-forced rows of ``sharpdraft eval`` (:func:`next_token_drafts`) and the proposer of the
speculative loop (:class:`LookupProposer`: lookup alone, or before any other proposer) all ask it.

>>> index = PromptLookup(LookupSettings(max_ngram=2))
>>> index.extend([5, 6, 7, 8, 5, 6])
>>> index.propose(3)  # "5 6" occurred first at 0: then came 7 8 5
[7, 8, 5]
>>> next_token_drafts([1, 2, 1, 2, 3]).tolist()  # entry j: the draft of token j from tokens 0 .. j-1
[-1, -1, -1, 2, 1, -1]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .speculative import Greedy, NoProposer

__all__ = ["DEFAULT_MAX_NGRAM", "DEFAULT_MIN_NGRAM", "MAX_NGRAM", "LookupSettings", "PromptLookup",
           "next_token_drafts", "LookupProposer"]

DEFAULT_MAX_NGRAM = 2  # transformers: max_matching_ngram_size, 2 when the generation config leaves it unset
DEFAULT_MIN_NGRAM = 1  # transformers searches down to 1-grams
MAX_NGRAM = 64  # longer suffixes are never needed to tell two places apart in practice; bounds the index


@dataclass(frozen=True)
class LookupSettings:
    """Prompt lookup's n-gram range and end-of-sequence token; ``ValueError`` naming a bad field."""

    max_ngram: int = DEFAULT_MAX_NGRAM  # the longest suffix matched, 1 .. MAX_NGRAM
    min_ngram: int = DEFAULT_MIN_NGRAM  # the shortest, 1 .. max_ngram
    eos_token_id: int | None = None  # drafts stop before it (None: the tokenizer has none)

    def __post_init__(self):
        for name in ("max_ngram", "min_ngram"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_NGRAM:
                raise ValueError(f"{name} must be an integer from 1 to {MAX_NGRAM}, got {value!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must be at most max_ngram ({self.max_ngram})")

    def to_dict(self) -> dict:
        return {"max_ngram": self.max_ngram, "min_ngram": self.min_ngram}


class PromptLookup:
    """Prompt lookup over a token sequence that grows (:meth:`extend`), proposing from all of it."""

    def __init__(self, settings: LookupSettings = LookupSettings()):
        self.settings = settings
        self.tokens: list[int] = []
        # m -> {m-gram: the first position where it starts}
        self.first: dict[int, dict[tuple[int, ...], int]] = {
            m: {} for m in range(self.settings.min_ngram, self.settings.max_ngram + 1)}

    def extend(self, tokens) -> None:
        """Append ``tokens`` (ints) to the context."""
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens)
            for m, first in self.first.items():
                if end >= m:
                    first.setdefault(tuple(self.tokens[end - m:]), end - m)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` drafted tokens after the context (the module docstring's rule); [] for none."""
        end, s = len(self.tokens), self.settings
        for m in range(min(s.max_ngram, end - 1), s.min_ngram - 1, -1):
            start = self.first[m][tuple(self.tokens[end - m:])]  # the suffix itself is indexed: always found
            if start + m < end:  # an earlier place, with a token after it
                draft = self.tokens[start + m:min(start + m + k, end)]
                if s.eos_token_id is not None and s.eos_token_id in draft:
                    draft = draft[:draft.index(s.eos_token_id)]
                return draft
        return []


def next_token_drafts(ids, settings: LookupSettings = LookupSettings()) -> np.ndarray:
    """Prompt lookup's draft of each token of ``ids`` (T,) from the tokens before it: (T + 1,) int64,
    entry ``j`` the first token :meth:`PromptLookup.propose` drafts after ``ids[:j]`` (-1: none);
    entry ``T`` drafts the token after the whole sequence."""
    index = PromptLookup(settings)
    out = np.full(len(ids) + 1, -1, dtype=np.int64)
    for j in range(len(ids) + 1):
        draft = index.propose(1)
        if draft:
            out[j] = draft[0]
        if j < len(ids):
            index.extend([ids[j]])
    return out


def _point_laws(drafts: list[int], vocab_size: int, rule) -> np.ndarray | None:
    """The laws of point-mass drafts for ``rule``: (len, vocab) one-hot float64 (None for greedy, which
    reads none). Speculative sampling then accepts draft ``x`` with probability ``min(1, p(x) / 1)``
    and at a rejection draws from ``p`` without ``x``: the target's law is kept."""
    if isinstance(rule, Greedy):
        return None
    laws = np.zeros((len(drafts), vocab_size))
    laws[np.arange(len(drafts)), drafts] = 1.0
    return laws


class LookupProposer:
    """Prompt lookup as a proposer (``calibrate.drafters.base.Proposer``) that wraps another: lookup's draft
    where it finds one, else ``inner``'s (any proposer; None: none, plain lookup), which sees every committed
    token either way (its ``commit`` follows each step). Named ``lookup``, or ``lookup+`` the inner's name.

    Lookup drafts up to ``k`` tokens (fewer, or none, where the context says so), the same whatever the
    rule: a draft is a point mass. ``vocab_size`` is the target's (the laws handed to sampling).
    """

    def __init__(self, vocab_size: int, settings: LookupSettings, inner=None):
        self.vocab_size, self.settings = int(vocab_size), settings
        self.inner = NoProposer() if inner is None else inner
        self.name = "lookup" if inner is None else f"lookup+{inner.name}"
        self.feature_ids = self.inner.feature_ids

    def start(self, prompt, features, pending: int) -> None:
        self.index = PromptLookup(self.settings)
        self.index.extend(prompt[0].tolist() + [pending])
        self.inner.start(prompt, features, pending)

    def propose(self, k: int, rule) -> tuple[list[int], np.ndarray | None]:
        drafts = self.index.propose(k)
        return (drafts, _point_laws(drafts, self.vocab_size, rule)) if drafts else self.inner.propose(k, rule)

    def commit(self, new: list[int], features) -> None:
        self.index.extend(new)
        self.inner.commit(new, features)

    def close(self) -> None:
        self.inner.close()
