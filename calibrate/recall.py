"""Recall sequences: text in which passages recur verbatim at set distances, with the copied tokens marked.

A drafter that uses its context copies: where a passage recurs, the key to copy from is one among
``n``, which is where dilution spreads attention mass and a window drops it. Natural text has few
verbatim repeats at known distances, so these sequences construct them from a corpus split:

* the split's text is read as one stream of tokens (documents joined as :func:`calibrate.corpus.pack`
  joins them) and never reused within a sequence, except by the repeats themselves;
* sequence ``i`` has one **distance** ``D``, the ``i``-th of the distances that fit its length, in
  turn: it is a run of blocks, each a fresh passage ``A`` of ``P(D)`` tokens, ``D - P(D)`` tokens of
  fresh filler, then ``A`` again, so the second copy starts exactly ``D`` tokens after the first.
  Blocks follow one another until the sequence is full (the last one cut where it must be);
* token ``t`` is **copied** when it lies in a second copy and is not its first token: the token
  before it is then copied context as well, so a drafter (or the target) that has found the source
  can predict it from what followed there, ``D`` tokens back.

Passages are ``P(D) = clamp(D // 2, 16, 256)`` tokens: a third of a short block is copied, and a
long repeat is long enough for a drafter to lock on. Everything is deterministic (no random
draws): the same stream, length and distances give the same sequences, so ``--resume`` can
continue a run over them.

>>> seqs = recall_sequences(iter(range(1000)), length=80, count=2, distances=(32, 48))
>>> [s.distance for s in seqs]
[32, 48]
>>> s = seqs[0]; t = [i for i, c in enumerate(s.copied) if c]
>>> all(s.ids[i] == s.ids[i - s.distance] for i in t), t[:3]
(True, [33, 34, 35])
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

__all__ = ["DISTANCES", "RecallSequence", "passage_length", "recall_sequences", "usable_distances"]

# Repeat distances in tokens: inside a 256-key window (48, 96, 160), then past it up to 8k.
DISTANCES = (48, 96, 160, 512, 1024, 2048, 3072, 4096, 6144, 7936)
MIN_PASSAGE, MAX_PASSAGE = 16, 256


@dataclass(frozen=True)
class RecallSequence:
    ids: list[int]  # token ids, exactly the requested length
    copied: np.ndarray  # (length,) bool: token t repeats token t - distance, and so does token t - 1
    distance: int  # how far back every copied token's source lies


def passage_length(distance: int) -> int:
    """Tokens in a repeated passage at ``distance``: ``clamp(distance // 2, 16, 256)``."""
    return min(max(distance // 2, MIN_PASSAGE), MAX_PASSAGE)


def usable_distances(length: int, distances: Iterable[int] = DISTANCES) -> list[int]:
    """The ``distances`` at which one whole block (passage, filler, passage) fits ``length`` tokens."""
    return [d for d in distances if d >= MIN_PASSAGE and d + passage_length(d) <= length]


def recall_sequences(stream: Iterator[int], length: int, count: int | None,
                     distances: Iterable[int] = DISTANCES) -> list[RecallSequence]:
    """``count`` recall sequences of ``length`` tokens (module docstring) from the token ``stream``
    (None: as many as the stream fills).

    Raises ``ValueError`` when no distance fits ``length``, or the stream runs out before ``count``
    sequences (or, with None, before one).
    """
    distances = tuple(distances)
    usable = usable_distances(length, distances)
    if not usable:
        raise ValueError(f"no repeat distance of {', '.join(map(str, distances))} fits sequences of {length} "
                         "tokens (a block is the distance plus one passage); use longer sequences")
    out = []
    while count is None or len(out) < count:
        d = usable[len(out) % len(usable)]
        p = passage_length(d)
        ids: list[int] = []
        copied: list[bool] = []
        while len(ids) < length:
            fresh = [t for _, t in zip(range(d), stream)]  # (d,): the passage, then the filler
            if len(fresh) < d:
                if count is None and out:
                    return out
                raise ValueError("the corpus ran out of text for the recall sequences; ask for fewer or "
                                 "shorter ones")
            ids += fresh + fresh[:p]
            copied += [False] * d + [False] + [True] * (p - 1)
        out.append(RecallSequence(ids[:length], np.asarray(copied[:length], dtype=bool), d))
    return out
