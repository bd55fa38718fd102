"""Distance-profile score model (theory.md section 8): i.i.d. limit, monotonicity, Monte Carlo, tail fits."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sharpdraft_theory import Empirical, Gaussian, annealed_mass, dilution_mass, exact_alpha
from sharpdraft_theory.distance import DistanceModel, DistanceProfile, fit_distance, fit_tail
from sharpdraft_theory.distance import exact_alpha as distance_alpha
from sharpdraft_theory.stats import RowStats, distance_edges, row_stats_from_logits

GRID = np.round(np.arange(0.5, 4.0001, 0.01), 6)


@st.composite
def gaussians(draw):
    sigma = draw(st.floats(0.2, 1.5))
    gap = draw(st.floats(sigma**2 + 1.0, sigma**2 + 8.0))
    return Gaussian(gap=gap, sigma=sigma, top_k=draw(st.integers(1, 8)))


def flat_model(model, alpha=GRID):
    """The i.i.d. model as a distance model: flat profile exp(K(a)), one row of planted top logits."""
    profile = DistanceProfile.from_tail(alpha, np.stack([model.log_mgf(alpha), np.zeros(alpha.size)]))
    return DistanceModel.single(profile, top=model.top_logits)


@given(gaussians(), st.lists(st.integers(16, 1 << 20), min_size=1, max_size=4))
def test_flat_profile_gives_the_iid_mass(model, lengths):
    n = np.asarray(lengths)
    got = flat_model(model).mass(n)  # (N, A)
    want = annealed_mass(model, n[:, None], GRID[None, :])
    # The flat sum is (n - k) e^K exactly (bins and midpoint rule are exact on a constant): round-off only.
    np.testing.assert_allclose(got, want, rtol=1e-10)


@given(st.lists(st.floats(-3.0, 3.0), min_size=3, max_size=30), st.integers(1, 4), st.floats(1.0, 6.0))
def test_flat_empirical_profile_gives_the_iid_mass(background, k, gap):
    model = Empirical(top=np.full(k, gap + max(background)), background=background)
    n = np.array([64, 4096])
    np.testing.assert_allclose(flat_model(model).mass(n), annealed_mass(model, n[:, None], GRID[None, :]), rtol=1e-10)


@given(gaussians(), st.integers(64, 2048), st.lists(st.floats(1.0, 300.0), min_size=1, max_size=3))
def test_flat_profile_gives_the_iid_correction(model, n_ref, factors):
    n = np.asarray([int(n_ref * f) for f in factors])
    ref = float(annealed_mass(model, n_ref, 1.0))
    got = distance_alpha(flat_model(model), n, mass_ref=ref)
    want = exact_alpha(model, n, n_ref)
    inside = want.reachable & (want.alpha <= GRID[-1])
    assert np.array_equal(got.reachable[inside], want.reachable[inside])
    # PCHIP on a 0.01 grid of a smooth mass curve; n rounded to an integer moves ln r by < 1 / n_ref.
    np.testing.assert_allclose(got.alpha[inside], want.alpha[inside], atol=2e-4)


@st.composite
def bounded_models(draw):
    """Profiles whose background never exceeds the lowest top logit (so the mass rises with a)."""
    alpha = np.round(np.arange(0.5, 3.0001, 0.25), 6)
    bins = draw(st.integers(2, 8))
    edges = np.cumsum([1] + draw(st.lists(st.integers(1, 40), min_size=bins, max_size=bins)))
    values = np.array(draw(st.lists(st.lists(st.floats(-8.0, 0.0), min_size=3, max_size=3), min_size=bins,
                                    max_size=bins)))  # (B, 3) background logits per bin
    log_weight = np.log(np.mean(np.exp(alpha[None, None, :] * values[:, :, None]), axis=1))
    c1, e1 = draw(st.floats(0.0, 4.0)), draw(st.floats(0.0, 1.0))
    profile = DistanceProfile(alpha=alpha, edges=edges, log_weight=log_weight, tail=np.stack([-c1 * alpha, -e1 * alpha]))
    top = np.array(draw(st.lists(st.floats(0.0, 4.0), min_size=1, max_size=6)))
    return DistanceModel.single(profile, top=top)


@given(bounded_models(), st.lists(st.integers(8, 1 << 18), min_size=2, max_size=5))
def test_mass_rises_with_alpha_and_falls_with_n(model, lengths):
    n = np.unique(lengths)
    mass = model.mass(n)
    # Each step is a sum of positive terms changing one way; 1e-12 absorbs round-off.
    assert np.all(np.diff(mass, axis=1) >= -1e-12)
    assert np.all(np.diff(mass, axis=0) <= 1e-12)


@given(bounded_models())
def test_correction_rises_with_n(model):
    n = np.unique(np.geomspace(16, 1 << 16, 12).astype(int))
    ref = float(model.mass([16])[0, np.argmin(np.abs(model.alpha - 1.0))])
    c = distance_alpha(model, n, mass_ref=ref)
    # The true a* rises with n; PCHIP on a 0.25 grid may wobble by ~1e-5 where a* has converged.
    assert np.all(np.diff(c.alpha[c.reachable]) >= -1e-4)
    # M falls with n at every a, so the reachable lengths are exactly those below the horizon
    # (bisection to 0.1% in n).
    clear = np.abs(np.log(n) - np.log(c.horizon_n)) > 2e-3
    np.testing.assert_array_equal(c.reachable[clear], (n < c.horizon_n)[clear])


def lognormal_tail(alpha, m0, m1, v0, v1):
    return np.stack([alpha * m0 + 0.5 * alpha**2 * v0, alpha * m1 + 0.5 * alpha**2 * v1])


@pytest.mark.parametrize("m0, m1, v0, v1, alpha", [
    (-1.0, -0.8, 0.5, 0.10, 1.0),  # mass 0.75
    (0.5, -0.5, 0.8, 0.08, 1.0),  # mass 0.09: the background dominates
    (-0.5, -0.5, 0.5, 0.10, 1.5),
    (1.0, -0.5, 0.3, 0.05, 2.0),
])
def test_monte_carlo_of_the_same_model(m0, m1, v0, v1, alpha):
    """Rows drawn under the model (logit at distance d ~ N(m0 + m1 ln d, v0 + v1 ln d)) match the formula."""
    top, n, rows = np.array([3.0, 2.0, 2.0, 1.0]), 4096, 400
    grid = np.array([alpha])
    model = DistanceModel.single(DistanceProfile.from_tail(grid, lognormal_tail(grid, m0, m1, v0, v1)), top=top)
    rng = np.random.default_rng(0)
    d = np.arange(top.size, n)
    z = m0 + m1 * np.log(d) + np.sqrt(v0 + v1 * np.log(d)) * rng.standard_normal((rows, d.size))
    s_t = np.sum(np.exp(alpha * top))
    mc = np.mean(s_t / (s_t + np.exp(alpha * z).sum(axis=1)))
    # Annealed new keys against quenched rows: within 1% inside the annealed regime ((a s)^2 <= ln N / 2).
    assert model.mass([n])[0, 0] == pytest.approx(mc, rel=0.01)


def test_monte_carlo_parts_ways_with_heavy_tails():
    """Past the freezing point a few keys carry the sum and its mean misleads: the model is off by far."""
    top, n, alpha = np.array([3.0, 2.0, 2.0, 1.0]), 4096, np.array([2.5])
    model = DistanceModel.single(DistanceProfile.from_tail(alpha, lognormal_tail(alpha, -1.0, -0.8, 2.0, 0.5)), top=top)
    d = np.arange(top.size, n)
    z = -1.0 - 0.8 * np.log(d) + np.sqrt(2.0 + 0.5 * np.log(d)) * np.random.default_rng(0).standard_normal((400, d.size))
    s_t = np.sum(np.exp(2.5 * top))
    mc = np.mean(s_t / (s_t + np.exp(2.5 * z).sum(axis=1)))
    assert model.mass([n])[0, 0] < 0.5 * mc  # this test can fail: the annealed mean sum overweights rare keys


def test_midpoint_tail_sum_against_brute_force():
    alpha = np.array([0.5, 1.0, 2.0])
    tail = lognormal_tail(alpha, -1.0, -0.9, 0.6, 0.1)
    profile = DistanceProfile.from_tail(alpha, tail, exact_below=64)
    d = np.arange(10, 50000)
    brute = np.log(np.exp(tail[0][None, :] + np.log(d)[:, None] * tail[1][None, :]).sum(axis=0))
    got = profile.log_sum([10], [50000])[0]
    # Exact below 64; the midpoint rule's relative error past 64 is ~e(e-1)/(24 d^2): under 1e-4.
    np.testing.assert_allclose(got, brute, rtol=0, atol=1e-4)


@pytest.mark.parametrize("form", ["power", "lognormal"])
def test_tail_fit_recovers_a_planted_lognormal(form):
    alpha = np.array([0.5, 1.0, 1.5, 2.0, 3.0])
    tail = lognormal_tail(alpha, -1.2, -1.1, 0.9, 0.3)
    edges = np.unique(np.round(2.0 ** (np.arange(0, 45) / 4)).astype(int))
    profile = DistanceProfile.from_tail(alpha, tail, exact_below=2)
    counts = np.diff(edges).astype(float)
    sums = np.exp(profile.log_sum(edges[:-1], edges[1:]))  # (B, A), exact bin sums of the planted form
    got, rms = fit_tail(alpha, edges, np.log(sums / counts[:, None]), counts, form=form, octaves=3)
    # Bin means of d^e against d at the bin's mean ln d: curvature error within a bin, <1e-2 nats.
    np.testing.assert_allclose(got, tail, atol=2e-2)
    assert rms < 1e-2


def test_bad_inputs():
    with pytest.raises(ValueError, match="tail form"):
        fit_tail([1.0], [1, 2, 3], np.zeros((2, 1)), np.ones(2), form="cubic")
    with pytest.raises(ValueError, match="edges"):
        DistanceProfile(alpha=[1.0], edges=[0, 2], log_weight=np.zeros((1, 1)), tail=np.zeros((2, 1)))
    with pytest.raises(ValueError, match="alpha grid"):
        p1 = DistanceProfile.from_tail([1.0], np.zeros((2, 1)))
        p2 = DistanceProfile.from_tail([2.0], np.zeros((2, 1)))
        DistanceModel(profiles=(p1, p2), group=np.zeros(1, int), n_row=np.ones(1, int), log_top=np.zeros((1, 1)),
                      log_rest=np.zeros((1, 1)), weight=np.ones(1))


def _planted_rows(lengths, seqs, rng, width, heads=2, seq0=0):
    """Rows whose logit at distance d is N(1 - (0.8 + 0.3 h) ln d, 0.3 + 0.05 ln d), a sink at 2 + N(0, 0.3), own key + 3."""
    parts = []
    for s in range(seqs):
        for h in range(heads):
            z = np.full((len(lengths), width), -np.inf)
            for i, n in enumerate(lengths):
                d = n - np.arange(n)
                z[i, :n] = 1.0 - (0.8 + 0.3 * h) * np.log(d) + np.sqrt(0.3 + 0.05 * np.log(d)) * rng.standard_normal(n)
                z[i, 0] = 2.0 + np.sqrt(0.3) * rng.standard_normal()  # the sink: the same whatever n
                z[i, n - 1] += 3.0
            parts.append(row_stats_from_logits(z, k_max=4, head=h, seq=seq0 + s, edges=distance_edges(width)))
    return RowStats.concat(parts)


@pytest.fixture(scope="module")
def planted():
    rng = np.random.default_rng(0)
    grid = np.unique(np.round(32 * 2 ** (np.arange(0, 25) / 8)).astype(int))  # 32 .. 256
    return _planted_rows(grid, 8, rng, 256), _planted_rows([2048], 30, rng, 2048)


def test_fitted_model_predicts_planted_rows_past_the_calibrated_lengths(planted):
    calibration, far = planted
    fit = fit_distance(calibration, n_ref=64, top_k=4)
    one = int(np.argmin(np.abs(fit.alpha - 1.0)))
    measured = far.mass(4)[:, far.index_of_one]
    for h in range(2):
        got = fit.mass([2048], granularity="head")[0, 0, h, one]
        want = measured[far.head == h].mean()
        # 30 rows of sampled logits (standard error ~0.005) and an 8x extrapolation of the fitted tail.
        assert got == pytest.approx(want, abs=0.02)
    iid = float(dilution_mass(fit.mass([256])[0, one], 2048, 256, 4))
    assert abs(iid - measured.mean()) > 0.1  # this test can fail: the i.i.d. law is far off here


def test_fitted_correction_has_a_band_and_rises(planted):
    calibration, _ = planted
    fit = fit_distance(calibration, n_ref=64, top_k=4)
    c = fit.exact_alpha([512, 2048, 8192], bootstrap=20)
    assert np.all(np.diff(c.alpha) > 0) and c.alpha[0] > 1
    assert np.all((c.low <= c.alpha) & (c.alpha <= c.high))
    per_head = fit.exact_alpha([2048], granularity="head")
    assert per_head.alpha.shape == (1, 1, 2) and per_head.mass_ref.shape == (1, 2)
    # the head whose logits fall faster with distance dilutes less and needs a smaller correction
    assert per_head.alpha[0, 0, 1] < per_head.alpha[0, 0, 0]


def test_fit_distance_refuses_statistics_without_a_profile():
    stats = row_stats_from_logits(np.random.default_rng(0).normal(size=(4, 40)), k_max=2)
    with pytest.raises(ValueError, match="no distance profile"):
        fit_distance(stats, n_ref=32, top_k=2)


def test_tail_fit_survives_weights_that_underflow_at_large_alpha():
    alpha = np.array([0.5, 1.0, 4.0])
    edges = np.array([1, 2, 4, 8, 16, 32])
    with np.errstate(divide="ignore"):
        log_weight = np.log(np.array([[0.1, 0.01, 0.0]] * 5))  # nothing left at a = 4 (float32 underflow)
    tail, _ = fit_tail(alpha, edges, log_weight, np.diff(edges).astype(float))
    np.testing.assert_allclose(tail[:, :2], [[np.log(0.1), np.log(0.01)], [0.0, 0.0]], atol=1e-12)
    assert tail[0, 2] <= -700 and tail[1, 2] == 0
