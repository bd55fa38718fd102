"""Exact correction, horizon, fixed slope, laws and Monte Carlo (theory.md section 7.3-7.8)."""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sharpdraft_theory import (Empirical, Gaussian, TwoLevel, alpha_law, annealed_mass, dilution_mass, exact_alpha,
                               horizon_log_ratio, horizon_n, least_squares_slope, log_ratio, monte_carlo_mass, regime,
                               tangent_slope)

gaps = st.floats(2.0, 10.0)
top_ks = st.integers(1, 8)
n_refs = st.integers(64, 4096)
growth = st.floats(1.0, 1e4)  # n / n_ref


@st.composite
def gaussians(draw):
    sigma = draw(st.floats(0.2, 2.0))
    gap = draw(st.floats(sigma**2 + 0.5, sigma**2 + 8.0))
    return Gaussian(gap=gap, sigma=sigma, top_k=draw(top_ks))


def lengths(n_ref, factors):
    return np.asarray([n_ref * f for f in factors])


@given(gaps, top_ks, n_refs, st.lists(growth, min_size=1, max_size=5))
def test_two_level_closed_form_equals_root(gap, k, n_ref, factors):
    model = TwoLevel(gap=gap, top_k=k)
    n = lengths(n_ref, factors)
    closed, root = exact_alpha(model, n, n_ref), exact_alpha(model, n, n_ref, method="root")
    # Brent with xtol 1e-14 on a linear g: agreement to round-off.
    np.testing.assert_allclose(closed.alpha, root.alpha, rtol=1e-10)


@given(gaussians(), n_refs, st.lists(growth, min_size=1, max_size=5))
def test_gaussian_closed_form_equals_root(model, n_ref, factors):
    n = lengths(n_ref, factors)
    closed, root = exact_alpha(model, n, n_ref), exact_alpha(model, n, n_ref, method="root")
    np.testing.assert_array_equal(closed.reachable, root.reachable)
    # Near the horizon g is flat (g' -> 0), so a tiny error in g moves the root more: rtol 1e-7.
    np.testing.assert_allclose(closed.alpha[closed.reachable], root.alpha[root.reachable], rtol=1e-7)


@given(gaussians(), n_refs)
def test_correction_is_one_at_n_ref_and_increasing(model, n_ref):
    n = np.geomspace(n_ref, n_ref * 1e4, 40)
    c = exact_alpha(model, n, n_ref)
    assert c.alpha[0] == pytest.approx(1.0, abs=1e-12)
    a = c.alpha[c.reachable]
    assert np.all(np.diff(a) > 0)


@given(gaussians(), n_refs)
def test_horizon_is_where_the_discriminant_vanishes(model, n_ref):
    d, s2 = model.gap, model.sigma**2
    log_r_max = horizon_log_ratio(model)
    assert log_r_max == pytest.approx((d - s2) ** 2 / (2 * s2), rel=1e-12)
    assume(log_r_max < 30)  # horizon lengths beyond e^30 n_ref are not representable as counts
    k = model.top_k
    inside = k + (n_ref - k) * np.exp(log_r_max * (1 - 1e-6))
    outside = k + (n_ref - k) * np.exp(log_r_max * (1 + 1e-6))
    c = exact_alpha(model, [inside, outside], n_ref)
    assert c.reachable.tolist() == [True, False]
    assert np.isnan(c.alpha[1])
    # At the horizon a* reaches the peak of g, a = D / s^2 (sqrt of a 1e-6-small discriminant: 1e-3).
    assert c.alpha[0] == pytest.approx(d / s2, rel=1e-2)
    assert horizon_n(model, n_ref) == pytest.approx(k + (n_ref - k) * np.exp(log_r_max), rel=1e-9)


@given(st.one_of(gaussians(), st.builds(TwoLevel, gap=gaps, top_k=top_ks)), n_refs)
def test_tangent_slope_is_derivative_at_r_equal_one(model, n_ref):
    h = 1e-5
    k = model.top_k
    n = k + (n_ref - k) * np.exp([-h, h])
    a = exact_alpha(model, n, n_ref).alpha
    # Central difference, error O(h^2 a''') ~ 1e-9; cancellation 1e-16 / 1e-5 ~ 1e-11.
    assert (a[1] - a[0]) / (2 * h) == pytest.approx(tangent_slope(model), rel=1e-6)


def test_tangent_slope_closed_forms():
    assert tangent_slope(TwoLevel(gap=4.0, top_k=2)) == pytest.approx(0.25, rel=1e-12)
    assert tangent_slope(Gaussian(gap=6.0, sigma=1.0, top_k=4)) == pytest.approx(0.2, rel=1e-12)


def test_least_squares_slope_exceeds_tangent_for_convex_correction():
    model = Gaussian(gap=6.0, sigma=1.0, top_k=4)
    ls = least_squares_slope(model, 512, 512 * 128)
    assert ls > tangent_slope(model)
    assert least_squares_slope(TwoLevel(gap=5.0, top_k=4), 512, 512 * 128) == pytest.approx(0.2, rel=2e-2)


@given(st.floats(0.01, 0.99), top_ks, n_refs, growth)
def test_dilution_law_lowers_log_odds_by_ln_r(m0, k, n_ref, f):
    n = n_ref * f
    m = dilution_mass(m0, n, n_ref, k)
    lhs = np.log(m / (1 - m))
    rhs = np.log(m0 / (1 - m0)) - log_ratio(n, n_ref, k)
    assert lhs == pytest.approx(rhs, abs=1e-9)


def test_dilution_law_matches_annealed_model():
    model = Gaussian(gap=6.0, sigma=1.0, top_k=4)
    m0 = annealed_mass(model, 512)
    n = np.array([1024, 4096, 16384])
    np.testing.assert_allclose(dilution_mass(m0, n, 512, 4), annealed_mass(model, n), rtol=1e-12)


# Monte Carlo is the expensive check: few examples, rows enough for ~0.3% standard errors.
@settings(max_examples=8)
@given(st.floats(0.3, 1.2), st.floats(3.0, 7.0), st.integers(1, 6), st.integers(128, 512), st.floats(2.0, 16.0))
def test_exact_correction_restores_quenched_mass(sigma, extra_gap, k, n_ref, f):
    model = Gaussian(gap=sigma**2 + extra_gap, sigma=sigma, top_k=k)
    n = int(n_ref * f)
    a = exact_alpha(model, [n], n_ref).alpha[0]
    assume(np.isfinite(a))
    assume(regime(model, [n_ref, n], [1.0, a]).tolist() == ["annealed", "annealed"])
    ref, ref_se = monte_carlo_mass(model, n_ref, 1.0, rows=300, seed=1)
    got, got_se = monte_carlo_mass(model, n, a, rows=300, seed=2)
    # Inside the annealed regime the quenched/annealed gap is <= ~1% of the mass at both lengths;
    # add 4 standard errors for the sampling noise.
    assert abs(got - ref) <= 0.01 + 4 * np.hypot(ref_se, got_se)


def test_done_criterion_gaussian_gap6_sigma1():
    """The issue's check: a* at 4096 and 65536 restores the Monte Carlo mass to within 1%."""
    model = Gaussian(gap=6.0, sigma=1.0, top_k=4)
    c = exact_alpha(model, [4096, 65536, 10**9], 512)
    ref, _ = monte_carlo_mass(model, 512, 1.0, rows=2000, seed=0)
    for n, a in zip([4096, 65536], c.alpha[:2]):
        got, se = monte_carlo_mass(model, n, a, rows=400 if n < 10**5 else 100, seed=3)
        unscaled, _ = monte_carlo_mass(model, n, 1.0, rows=100, seed=3)
        assert abs(got - ref) <= 0.01 * ref, (n, a, got, ref, se)
        assert unscaled < 0.5 * ref  # and the correction was needed
    assert not c.reachable[2] and c.horizon_n < 10**9


def test_monte_carlo_leaves_annealed_formula_when_frozen():
    model = Gaussian(gap=12.0, sigma=3.0, top_k=2)
    assert regime(model, [2048, 2048], [0.5, 1.5]).tolist() == ["annealed", "frozen"]
    mc, _ = monte_carlo_mass(model, 2048, [0.5, 1.5], rows=400, seed=0)
    an = annealed_mass(model, 2048, np.array([0.5, 1.5]))
    gap = np.log(mc / (1 - mc)) - np.log(an / (1 - an))
    # Annealed regime: log-odds agree to ~0.1 nat. Frozen: the annealed sum is dominated by rare
    # huge terms a finite row does not have, so it under-predicts the quenched mass by > 0.5 nat.
    assert abs(gap[0]) < 0.1 and gap[1] > 0.5


def test_regime_thresholds_match_gaussian_formulas():
    model = Gaussian(gap=6.0, sigma=1.0, top_k=4)
    big_n = 4 + 10**6
    ln_n = np.log(10**6)
    a_half = np.sqrt(ln_n / 2) * 0.99
    a_frozen = np.sqrt(2 * ln_n) * 1.01
    labels = regime(model, [big_n] * 3, [a_half, 0.5 * (a_half + a_frozen), a_frozen]).tolist()
    assert labels == ["annealed", "crossover", "frozen"]
    assert regime(TwoLevel(gap=3.0, top_k=1), [10**6], [9.0]).tolist() == ["annealed"]


def test_empirical_model_agrees_with_gaussian_on_a_large_sample():
    rng = np.random.default_rng(0)
    g = Gaussian(gap=6.0, sigma=1.0, top_k=4)
    e = Empirical(top=g.top_logits, background=g.sample_background(rng, 400_000))
    a_g = exact_alpha(g, [4096, 32768], 512).alpha
    a_e = exact_alpha(e, [4096, 32768], 512).alpha
    # The empirical log-MGF of 4e5 normals at a <= 2 is within ~1e-2 of a^2/2.
    np.testing.assert_allclose(a_e, a_g, rtol=1e-2)


def test_bad_models_are_rejected():
    with pytest.raises(ValueError, match="sigma must be a finite number > 0"):
        Gaussian(gap=6.0, sigma=0.0, top_k=4)
    with pytest.raises(ValueError, match="top_k must be an integer >= 1"):
        TwoLevel(gap=1.0, top_k=0)
    with pytest.raises(ValueError, match="n_ref=4 must exceed top_k=4"):
        exact_alpha(TwoLevel(gap=1.0, top_k=4), [10], 4)


# --- laws (theory.md section 7.8) -----------------------------------------------------------
ns = st.lists(st.integers(1, 10**7), min_size=1, max_size=20)


@given(ns, st.integers(2, 10**5))
def test_qwen_logn_is_log_linear_with_slope_one_over_ln_n_ref(n, n_ref):
    n = np.asarray(n)
    qwen = alpha_law("qwen-logn", n, n_ref=n_ref)
    linear = alpha_law("log-linear", n, n_ref=n_ref, slope=1 / np.log(n_ref))
    np.testing.assert_allclose(qwen, linear, rtol=1e-12)
    # Qwen's own definition, max(1, ln n / ln n_ref): the two forms differ by rounding only (O(1) values).
    np.testing.assert_allclose(qwen, np.maximum(1.0, np.log(n) / np.log(n_ref)), rtol=1e-14)


@given(ns, st.floats(0.01, 2.0))
def test_ssmax_is_s_ln_n(n, s):
    np.testing.assert_allclose(alpha_law("ssmax", n, slope=s), s * np.log(n), rtol=1e-14)


@given(ns, st.integers(2, 10**5), st.floats(0.0, 1.0), st.floats(1.0, 4.0))
def test_log_linear_is_one_up_to_n_ref_and_capped(n, n_ref, slope, cap):
    n = np.asarray(n)
    a = alpha_law("log-linear", n, n_ref=n_ref, slope=slope, alpha_max=cap)
    assert np.all(a[n <= n_ref] == 1.0)
    assert np.all(a <= cap) and np.all(a >= 1.0)


def test_llama4_temperature_tuning():
    # Llama 4: 1 + attn_scale * ln(floor((pos + 1) / floor_scale) + 1), n = pos + 1.
    a = alpha_law("llama4", [1, 8191, 8192, 3 * 8192], n_ref=8192, slope=0.1)
    np.testing.assert_allclose(a, [1.0, 1.0, 1 + 0.1 * np.log(2), 1 + 0.1 * np.log(4)], rtol=1e-14)


def test_constant_law_and_per_head_broadcast():
    np.testing.assert_array_equal(alpha_law("constant", [5, 50], slope=0.5), [1.5, 1.5])
    per_head = alpha_law("log-linear", np.array([256, 1024])[:, None], n_ref=256, slope=np.array([0.0, 0.5]))
    assert per_head.shape == (2, 2) and per_head[1, 0] == 1.0 and per_head[1, 1] > 1.0


def test_unknown_law_and_missing_parameters():
    with pytest.raises(ValueError, match="unknown law 'logn'; choose one of log-linear, "):
        alpha_law("logn", [1])
    with pytest.raises(ValueError, match="needs n_ref"):
        alpha_law("log-linear", [1], slope=0.1)
    with pytest.raises(ValueError, match="'ssmax' needs a slope"):
        alpha_law("ssmax", [1])


@given(st.floats(0.01, 0.99), top_ks, n_refs, growth, st.floats(0.0, 2.0))
def test_dilution_exponent_scales_the_log_odds_drop(m0, k, n_ref, f, gamma):
    n = n_ref * f
    m = dilution_mass(m0, n, n_ref, k, gamma=gamma)
    assert np.log(m / (1 - m)) == pytest.approx(np.log(m0 / (1 - m0)) - gamma * log_ratio(n, n_ref, k), abs=1e-9)
