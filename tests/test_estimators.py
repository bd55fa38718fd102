"""Slope estimators recover a slope planted in synthetic rows (theory.md section 7.7)."""

import numpy as np
import pytest

from sharpdraft_theory import Gaussian, TwoLevel, least_squares_slope, tangent_slope
from sharpdraft_theory.estimators import ESTIMATORS, REGISTRY, bucket_index, fit_slopes, get_estimator
from sharpdraft_theory.stats import RowStats, row_stats_from_logits

N_REF = 256
N_MAX = 4096


def planted_rows(model, sequences=6, layers=1, heads=1, seed=0, gap_by_group=None):
    """Causal-prefill-like rows: at each sampled n, the planted top set plus n - k background logits."""
    rng = np.random.default_rng(seed)
    ns = np.unique(np.geomspace(96, N_MAX, 36).astype(int))
    parts = []
    for seq in range(sequences):
        for layer in range(layers):
            for head in range(heads):
                m = model if gap_by_group is None else gap_by_group(layer, head)
                z = np.full((ns.size, N_MAX), -np.inf)
                for i, n in enumerate(ns):
                    z[i, : n - m.top_k] = m.sample_background(rng, n - m.top_k)
                    z[i, n - m.top_k : n] = m.top_logits
                parts.append(row_stats_from_logits(z, k_max=8, layer=layer, head=head, seq=seq))
    return RowStats.concat(parts)


@pytest.fixture(scope="module")
def gaussian_rows():
    return planted_rows(Gaussian(gap=6.0, sigma=1.0, top_k=4))


def test_gaussian_planted_slope_is_recovered(gaussian_rows):
    model = Gaussian(gap=6.0, sigma=1.0, top_k=4)
    fit = fit_slopes(gaussian_rows, n_ref=N_REF, top_k=4, bootstrap=100)
    e1, e2, e3 = (fit.result(e) for e in ("mass-matching", "closed-form", "gaussian"))
    # E1 matches the exact correction bucket by bucket, so it recovers the least-squares slope of
    # a* over the measured range; E2 and E3 linearise at n_ref, so they recover the tangent 1 / (D - s^2).
    # 6 sequences x 36 lengths: sampling error of a few percent; 4% tolerance.
    assert e1.slope == pytest.approx(least_squares_slope(model, N_REF, N_MAX * 0.85), rel=0.04)
    assert e2.slope == pytest.approx(tangent_slope(model), rel=0.04)
    assert e3.slope == pytest.approx(tangent_slope(model), rel=0.04)
    assert e1.ci_low < e1.slope < e1.ci_high
    assert e1.diagnostics["r2"] > 0.98
    assert e2.diagnostics["gamma"] == pytest.approx(1.0, abs=0.05)  # i.i.d. background: gamma = 1
    assert abs(e3.diagnostics["tilted_mean_error"]) < 0.05  # the background is Gaussian
    # Bucket masses fall past n_ref, and the matched alphas rise.
    past = [b for b in fit.buckets if b.n > N_REF]
    assert all(a.mass > b.mass for a, b in zip(past, past[1:]))
    assert all(a.alpha < b.alpha for a, b in zip(past, past[1:]))


def test_two_level_planted_slope_is_recovered():
    model = TwoLevel(gap=5.0, top_k=2)
    fit = fit_slopes(planted_rows(model, sequences=2), n_ref=N_REF, top_k=2, bootstrap=0)
    # Deterministic rows, exact linear law 1 / D in ln r ~ ln(n / n_ref): grid interpolation only.
    assert fit.result("mass-matching").slope == pytest.approx(0.2, rel=0.02)
    assert fit.result("closed-form").slope == pytest.approx(0.2, rel=0.02)


def test_per_head_slopes_follow_per_head_gaps():
    gaps = {(0, 0): 5.0, (0, 1): 8.0, (1, 0): 6.0, (1, 1): 10.0}
    stats = planted_rows(None, sequences=2, layers=2, heads=2,
                         gap_by_group=lambda l, h: TwoLevel(gap=gaps[l, h], top_k=2))
    fit = fit_slopes(stats, n_ref=N_REF, top_k=2, granularity="head", bootstrap=0)
    expected = np.array([[1 / 5, 1 / 8], [1 / 6, 1 / 10]])
    np.testing.assert_allclose(fit.slopes["mass-matching"], expected, rtol=0.03)
    layer_fit = fit_slopes(stats, n_ref=N_REF, top_k=2, granularity="layer", bootstrap=0)
    assert layer_fit.slopes["closed-form"].shape == (2,)


def test_bucket_index_puts_the_reference_window_in_minus_one_and_zero():
    assert bucket_index([129, 181, 182, 256, 257, 362, 513], 256).tolist() == [-1, -1, 0, 0, 1, 1, 3]


def test_clear_errors_when_lengths_do_not_straddle_n_ref(gaussian_rows):
    with pytest.raises(ValueError, match="no rows with n > n_ref=4096"):
        fit_slopes(gaussian_rows, n_ref=4096, top_k=4)
    with pytest.raises(ValueError, match="no rows with n in \\(16, 32\\]"):
        fit_slopes(gaussian_rows, n_ref=32, top_k=4)
    with pytest.raises(ValueError, match="granularity must be"):
        fit_slopes(gaussian_rows, n_ref=N_REF, top_k=4, granularity="tensor")


def test_attention_sink_rows_do_not_break_the_closed_form(gaussian_rows):
    """Rows with nearly all mass on the top set (sinks) stored in float32 cannot resolve their
    background's tilted mean; E2 must leave them out instead of dividing round-off by ~0."""
    rng = np.random.default_rng(5)
    z = rng.normal(size=(40, 200))  # n = 200: inside the reference window (128, 256]
    z[:, :4] = 40.0  # background share ~ 200 e^-40: far below float32 resolution
    sinks = row_stats_from_logits(z, k_max=8, seq=0)
    as_fp32 = {f: getattr(sinks, f).astype(np.float32) for f in ("top", "lse", "tilted_mean", "mean", "var")}
    sinks = RowStats(**{**{f: getattr(sinks, f) for f in ("n", "layer", "head", "seq", "alpha_grid")}, **as_fp32})
    clean = fit_slopes(gaussian_rows, n_ref=N_REF, top_k=4, bootstrap=0).result("closed-form")
    mixed = fit_slopes(RowStats.concat([gaussian_rows, sinks]), n_ref=N_REF, top_k=4, bootstrap=0)
    e2 = mixed.result("closed-form")
    assert e2.diagnostics["sink_rows_left_out"] == 40
    assert e2.slope == pytest.approx(clean.slope, rel=0.05)  # the sinks only move E1/E3's means a little


# --- the estimator registry ------------------------------------------------------------------
@pytest.mark.parametrize("spelling,name", [
    ("mass-matching", "mass-matching"), ("E1", "mass-matching"), ("e1", "mass-matching"),
    (" Mass_Matching ", "mass-matching"), ("closed-form", "closed-form"), ("e2", "closed-form"),
    ("closed_form", "closed-form"), ("gaussian", "gaussian"), ("E3", "gaussian"), ("gaussian-fit", "gaussian")])
def test_estimator_spellings_resolve_to_the_canonical_name(spelling, name):
    assert get_estimator(spelling).name == name


def test_estimator_registry_is_consistent(gaussian_rows):
    spellings = [s.lower() for e in REGISTRY.values() for s in (e.name, e.label, *e.aliases)]
    assert len(spellings) == len(set(spellings))  # no spelling names two estimators
    assert ESTIMATORS == tuple(REGISTRY) == ("mass-matching", "closed-form", "gaussian")
    assert [e.label for e in REGISTRY.values()] == ["E1", "E2", "E3"]
    with pytest.raises(ValueError, match=r"unknown estimator 'e4'; choose one of mass-matching \(E1\), "
                                         r"closed-form \(E2\), gaussian \(E3\)"):
        get_estimator("e4")
    fit = fit_slopes(gaussian_rows, n_ref=N_REF, top_k=4, bootstrap=0)
    assert tuple(r.estimator for r in fit.results) == ESTIMATORS == tuple(fit.slopes)
    assert fit.result("E2") is fit.result("closed-form")


def test_calibrate_cli_takes_any_estimator_spelling(tmp_path, monkeypatch):
    """``--estimator E3`` reaches the calibration as ``gaussian``; an unknown one stops before any work."""
    from typer.testing import CliRunner

    import calibrate.run
    from calibrate.cli import app
    from calibrate.errors import UserError

    seen = []

    class Stop(Exception):
        pass

    def fake_run(opts, **_):
        seen.append(opts)
        raise Stop

    monkeypatch.setattr(calibrate.run, "run_calibration", fake_run)
    res = CliRunner().invoke(app, ["calibrate", "--out", str(tmp_path / "s.json"), "--estimator", "E3"])
    assert isinstance(res.exception, Stop) and seen[0].estimator == "gaussian"
    res = CliRunner().invoke(app, ["calibrate", "--out", str(tmp_path / "s.json"), "--estimator", "e4"])
    assert isinstance(res.exception, UserError) and "--estimator e4: unknown estimator 'e4'" in str(res.exception)
    assert len(seen) == 1


# --- statistics of separate runs -------------------------------------------------------------
def test_separate_runs_are_separate_bootstrap_units():
    """Two runs of one sequence each, both numbered 0: joined as separate runs they are two
    sequences, so the bootstrap resamples two units (its draws are run A alone, both, run B alone)."""
    model = Gaussian(gap=6.0, sigma=1.0, top_k=4)
    run_a, run_b = (planted_rows(model, sequences=1, seed=seed) for seed in (1, 2))
    alone = [fit_slopes(run, n_ref=N_REF, top_k=4, bootstrap=40).result("mass-matching") for run in (run_a, run_b)]
    assert all(r.ci_low is None and "one sequence: no bootstrap interval" in r.note for r in alone)
    with pytest.raises(ValueError, match="same row twice .* separate_runs=True"):
        RowStats.concat([run_a, run_b])
    joined = RowStats.concat([run_a, run_b], separate_runs=True)
    assert np.unique(joined.seq).tolist() == [0, 1]
    both = fit_slopes(joined, n_ref=N_REF, top_k=4, bootstrap=40).result("mass-matching")
    assert both.note is None
    # The extreme draws put all weight on one run: the interval spans the two runs' own slopes.
    assert [both.ci_low, both.ci_high] == pytest.approx(sorted(r.slope for r in alone), rel=1e-9)
    assert both.ci_low < both.slope < both.ci_high
