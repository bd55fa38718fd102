"""Top-k mass, log-odds and tilted means against direct float64 softmax (theory.md section 7.1-7.2)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from sharpdraft_theory import n_visible, tilted_mean, topk_log_odds, topk_mass
from sharpdraft_theory.stats import RowStats, row_stats_from_logits

# Logits of real attention rows stay within a few tens; alpha within (0, 10].
logit = st.floats(-30.0, 30.0, allow_nan=False, allow_subnormal=False)
rows = arrays(np.float64, st.tuples(st.integers(1, 4), st.integers(3, 40)), elements=logit)


def softmax_mass(z, k, a):
    p = np.exp(a * z - np.max(a * z, axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.sort(p, axis=-1)[..., -k:].sum(axis=-1)


@given(rows, st.integers(1, 2), st.floats(0.0, 5.0))
def test_mass_matches_direct_softmax(z, k, a):
    # Direct float64 softmax of at most 40 terms of size <= e^150: relative error ~1e-15.
    np.testing.assert_allclose(topk_mass(z, k, a), softmax_mass(z, k, a), rtol=1e-12, atol=1e-300)


@given(rows, st.integers(1, 2), st.floats(0.0, 4.0), st.floats(0.001, 2.0))
def test_mass_non_decreasing_in_alpha(z, k, a, step):
    # d l_k / d a = zbar_T - zbar_B >= 0; allow round-off of a few ulps of a mass.
    assert np.all(topk_mass(z, k, a + step) >= topk_mass(z, k, a) - 1e-12)


@given(rows, st.integers(1, 2))
def test_mass_at_zero_is_k_over_n(z, k):
    np.testing.assert_allclose(topk_mass(z, k, 0.0), k / z.shape[-1], rtol=1e-14)


@given(rows, st.integers(1, 2), st.floats(0.1, 3.0), st.floats(-50.0, 50.0))
def test_softmax_shift_invariance(z, k, a, c):
    # Shifting 30-sized logits by 50 loses ~6 bits of the smallest ones: rtol 1e-9.
    np.testing.assert_allclose(topk_log_odds(z + c, k, a), topk_log_odds(z, k, a), rtol=1e-9, atol=1e-9)


@given(rows, st.integers(1, 2), st.floats(0.0, 4.0), st.lists(st.floats(0.0, 20.0), min_size=1, max_size=30))
def test_adding_background_keys_never_raises_mass(z, k, a, drops):
    # A new key no larger than the k-th largest logit joins the background: S_B grows, S_T stays.
    kth = np.sort(z, axis=-1)[..., -k][..., None]
    extra = kth - np.asarray(drops)[None, :]
    longer = np.concatenate([z, np.broadcast_to(extra, z.shape[:-1] + extra.shape[-1:])], axis=-1)
    assert np.all(topk_mass(longer, k, a) <= topk_mass(z, k, a) + 1e-12)


def test_large_alpha_and_logits_do_not_overflow():
    z = np.array([[50.0, 49.0, 0.0, -50.0]])
    m = topk_mass(z, 1, alpha=10.0)
    assert np.isfinite(m).all() and m[0] == pytest.approx(1.0 / (1.0 + np.exp(-10.0)), rel=1e-12)


def test_masked_keys_do_not_count():
    z = np.array([[3.0, 1.0, 0.0, -np.inf, -np.inf]])
    assert n_visible(z).tolist() == [3]
    np.testing.assert_allclose(topk_mass(z, 1), topk_mass(z[:, :3], 1), rtol=1e-15)
    np.testing.assert_allclose(tilted_mean(z), tilted_mean(z[:, :3]), rtol=1e-15)


def test_bad_top_k_is_rejected():
    with pytest.raises(ValueError, match="top_k=3 must be smaller"):
        topk_mass(np.zeros((1, 3)), 3)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        topk_mass(np.zeros((1, 3)), 0)


@given(arrays(np.float64, st.tuples(st.integers(1, 5), st.integers(12, 60)), elements=st.floats(-20.0, 20.0)),
       st.integers(1, 8))
def test_row_stats_reproduce_mass_and_moments(z, k):
    stats = row_stats_from_logits(z, k_max=8)
    i1 = stats.index_of_one
    # Both sides are float64 log-space computations of the same sums: 1e-10 relative.
    np.testing.assert_allclose(stats.mass(k)[:, i1], topk_mass(z, k), rtol=1e-10, atol=1e-300)
    for j, a in enumerate(stats.alpha_grid[::20]):
        np.testing.assert_allclose(stats.mass(k)[:, j * 20], topk_mass(z, k, a), rtol=1e-10, atol=1e-300)
    srt = np.sort(z, axis=1)
    bg, top = srt[:, :-k], srt[:, -k:]
    mu, var = stats.background_moments(k)
    # Moments by removing the top set from whole-row sums: cancellation on 20-sized logits, 1e-9.
    np.testing.assert_allclose(mu, bg.mean(axis=1), atol=1e-9)
    np.testing.assert_allclose(var, bg.var(axis=1), atol=1e-8)
    zt, zb = stats.tilted_means(k)
    np.testing.assert_allclose(zt, tilted_mean(top), atol=1e-9)
    # zbar_B by subtraction divides by 1 - M; rows with M ~ 1 lose digits, so compare where M < 0.999.
    ok = stats.mass(k)[:, i1] < 0.999
    np.testing.assert_allclose(zb[ok], tilted_mean(bg)[ok], atol=1e-6)


def test_row_stats_round_trip_and_concat(tmp_path):
    rng = np.random.default_rng(0)
    a = row_stats_from_logits(rng.normal(size=(3, 30)), k_max=4, seq=0)
    b = row_stats_from_logits(rng.normal(size=(2, 30)), k_max=4, seq=1)
    joined = RowStats.concat([a, b])
    joined.save(tmp_path / "s.npz", drafter="hf")
    back, meta = RowStats.load(tmp_path / "s.npz")
    assert meta == {"drafter": "hf"} and back.rows == 5
    np.testing.assert_array_equal(back.lse, joined.lse)
    with pytest.raises(ValueError, match="different k_max"):
        RowStats.concat([a, row_stats_from_logits(rng.normal(size=(1, 30)), k_max=3)])
    with pytest.raises(ValueError, match="cannot be read"):
        RowStats.load(tmp_path / "missing.npz")


def test_concat_keeps_runs_apart_and_one_run_together():
    rng = np.random.default_rng(1)

    def part(seq, layer=0, rows=2):
        return row_stats_from_logits(rng.normal(size=(rows, 30)), k_max=4, seq=seq, layer=layer)

    # One run split by layer: sequence 3 spans both parts and keeps its id.
    assert RowStats.concat([part(3, layer=0), part(3, layer=1)]).seq.tolist() == [3, 3, 3, 3]
    # Two runs numbered alike: refused unless declared separate, then shifted past each other.
    a, b = part([3, 7]), part([0, 5])
    with pytest.raises(ValueError, match=r"same row twice \(sequence 3, layer 0, head 0, n 30\).*separate_runs=True"):
        RowStats.concat([a, part([3, 3])])
    c = part([0, 0])
    joined = RowStats.concat([a, b, c], separate_runs=True)
    assert joined.seq.tolist() == [3, 7, 8, 13, 14, 14]  # first run kept; order and gaps kept within a run
    plain = RowStats.concat([a, b])  # ids {3, 7} and {0, 5} hold no common row: joined as they are
    assert plain.seq.tolist() == [3, 7, 0, 5]
    np.testing.assert_array_equal(joined.lse[:4], plain.lse)  # only the ids change
