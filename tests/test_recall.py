"""Recall sequences (calibrate.recall): verbatim repeats at the stated distance, copied tokens marked."""

import doctest

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import calibrate.recall as recall
from calibrate.recall import DISTANCES, passage_length, recall_sequences, usable_distances


def test_doctests():
    assert doctest.testmod(recall).failed == 0


@settings(derandomize=True, max_examples=60, deadline=None)
@given(length=st.integers(72, 3000), count=st.integers(1, 6))
def test_copied_tokens_repeat_their_source_and_nothing_else_repeats(length, count):
    seqs = recall_sequences(iter(range(10**6)), length, count)  # distinct stream tokens: repeats are ours only
    usable = usable_distances(length)
    for i, s in enumerate(seqs):
        assert len(s.ids) == length and s.copied.shape == (length,)
        assert s.distance == usable[i % len(usable)]
        ids = np.asarray(s.ids)
        t = np.flatnonzero(s.copied)
        assert np.array_equal(ids[t], ids[t - s.distance])
        # every token that repeats one D back is marked, except the first of each copy
        repeats = np.flatnonzero(ids[s.distance:] == ids[:-s.distance]) + s.distance
        first = repeats[~np.isin(repeats - 1, repeats)]
        assert np.array_equal(np.setdiff1d(repeats, first), t)
    # the stream is never reused: every token outside the second copies is new
    second = [np.flatnonzero(np.r_[s.copied[1:], False] | s.copied) for s in seqs]
    fresh = np.concatenate([np.delete(np.asarray(s.ids), k) for s, k in zip(seqs, second)])
    assert len(np.unique(fresh)) == len(fresh)


def test_distances_that_do_not_fit_are_skipped():
    assert usable_distances(256) == [48, 96, 160]
    assert max(usable_distances(8192)) == 7936 and 7936 + passage_length(7936) == 8192
    assert passage_length(10) == 16 and passage_length(4096) == 256


def test_refusals():
    with pytest.raises(ValueError, match="fits sequences of 20 tokens"):
        recall_sequences(iter(range(100)), 20, 1)
    with pytest.raises(ValueError, match="ran out of text"):
        recall_sequences(iter(range(100)), 512, 1, distances=DISTANCES)


def test_every_sequence_the_stream_fills():
    """``count=None``: as many whole sequences as the stream fills, the same as asking for that many."""
    seqs = recall_sequences(iter(range(1000)), 80, None, distances=(32, 48))
    # two blocks per sequence, each D fresh stream tokens: 64 + 96 per pair of sequences, 6 pairs in 1,000
    assert len(seqs) == 12
    assert [s.ids for s in seqs] == [s.ids for s in recall_sequences(iter(range(1000)), 80, 12, distances=(32, 48))]
    with pytest.raises(ValueError, match="ran out of text"):
        recall_sequences(iter(range(1000)), 80, 13, distances=(32, 48))
    with pytest.raises(ValueError, match="ran out of text"):
        recall_sequences(iter(range(10)), 80, None)
