"""Acceptance by output position: bins, the fade, the geometric mean, loops (calibrate.measure.longgen)."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import calibrate.measure.longgen as longgen
from calibrate.measure.longgen import (acceptance_by_bin, bin_tallies, fade, geometric_mean, looped, step_positions,
                                       text_by_bin)

runs = st.lists(st.integers(0, 5), min_size=1, max_size=200)


def test_doctests():
    assert doctest.testmod(longgen).failed == 0


@settings(derandomize=True, max_examples=200, deadline=None)
@given(runs, st.integers(1, 64))
def test_bins_partition_every_verification_and_token(accepted, bin_size):
    bins = (1 + sum(a + 1 for a in accepted)) // bin_size + 1  # enough to hold every start
    forwards, tokens = bin_tallies(accepted, bin_size, bins)
    assert forwards.sum() == len(accepted) and tokens.sum() == sum(a + 1 for a in accepted)
    starts = step_positions(accepted)
    assert starts[0] == 1 and np.all(np.diff(starts) == np.asarray(accepted[:-1]) + 1)


@settings(derandomize=True, max_examples=100, deadline=None)
@given(st.lists(runs, min_size=1, max_size=6))
def test_one_wide_bin_is_the_pooled_acceptance_length(prompts):
    (mean, lo, hi), = acceptance_by_bin(prompts, bin_size=10**6, bins=1)
    pooled = sum(a + 1 for r in prompts for a in r) / sum(len(r) for r in prompts)
    assert mean == pytest.approx(pooled, rel=1e-12)  # float64 sums of integers
    if len(prompts) > 1:
        assert lo <= mean + 1e-12 and mean - 1e-12 <= hi
    else:
        assert lo is None and hi is None


def test_the_fade_of_a_drafter_that_stops_being_accepted_and_of_one_that_does_not():
    fading = [[4] * 20 + [0] * 100 for _ in range(3)]  # 100 tokens at 5 a forward, then 1 a forward
    steady = [[2] * 60 for _ in range(3)]
    assert fade(fading, bin_size=50)[0] == pytest.approx(1 / 5)
    assert fade(steady, bin_size=50) == [pytest.approx(1.0)] * 3
    assert fade([[1, 1]], bin_size=50) is None  # never leaves the first bin


def test_bins_past_the_end_are_none_and_the_geometric_mean_brackets_its_interval():
    assert acceptance_by_bin([[0, 0]], bin_size=2, bins=3)[2] is None
    early, late = acceptance_by_bin([[3] * 10, [0, 0]], bin_size=8, bins=3)[::2]  # the second ends in bin 0
    assert early[1] is not None and late == [4.0, None, None]  # one prompt behind a bin: no interval
    g = geometric_mean([1.5, 2.0, 2.5, 1.8])
    assert g[1] <= g[0] <= g[2] and g[0] == pytest.approx((1.5 * 2.0 * 2.5 * 1.8) ** 0.25)
    with pytest.raises(ValueError, match="positive"):
        geometric_mean([1.0, 0.0])


def test_a_loop_is_found_with_its_period_and_text_statistics_show_it():
    rng = np.random.default_rng(0)
    text = rng.integers(0, 1000, 600).tolist()
    cycle = rng.integers(0, 1000, 17).tolist()
    looping = text + cycle * 40
    assert looped(looping) == 17 and looped(text) is None and looped(text[:100]) is None
    stats = text_by_bin(looping, bin_size=600, bins=4)  # 1,280 tokens: bin 3 is past the end
    assert stats["distinct_4grams"][0] > 0.99 and stats["distinct_4grams"][1] < 0.05  # 17 distinct of 600
    assert stats["lookup_right"][0] < 0.02 and stats["lookup_right"][1] > 0.95
    assert np.isnan(stats["lookup_right"][3])
