"""The tabulated law's knots past the calibrated lengths: the distance model's exact correction
where the statistics hold a distance profile, the fixed slope (unchanged) where they do not."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.fit import Collection, FitSettings, fit_spec
from sharpdraft_theory.distance import fit_distance
from sharpdraft_theory.estimators import fit_slopes
from sharpdraft_theory.laws import MAX_N, alpha_law
from sharpdraft_theory.spec import DrafterInfo, ScaleSpec, schema_path
from sharpdraft_theory.stats import DEFAULT_ALPHA_GRID, RowStats, distance_edges, row_stats_from_logits
from sharpdraft_theory.tabulate import DISTANCE_MODEL, FIXED_SLOPE, MIXED, extrapolate, tabulate

ROOT = Path(__file__).resolve().parents[1]
N_REF, TOP_K, MAX_N_TABLE = 64, 4, 8192
GAPS = (1.0, 4.0, 6.0)  # per head: the top set's logit above a flat background of zeros
# A gap of 1 needs alpha past the profile's grid (4) from n ~ 1240 on: out of the model's reach there.


def two_level_stats() -> RowStats:
    """Rows of ``TOP_K`` logits at ``GAPS[h]`` over exact zeros (the sink included), n = 32 .. 512.

    The distance profile is flat, ``P(a, d) = exp(-a G)`` at every distance, so the distance model
    is the two-level law: ``M(a; n) = k / (k + (n - k) exp(-a G))`` (theory.md section 7, special case).
    """
    lengths = np.unique(np.round(32 * 2.0 ** (np.arange(33) / 8)).astype(np.int64))  # 8 per octave to 512
    width = int(lengths.max())
    parts = []
    for seq in range(2):
        for head, gap in enumerate(GAPS):
            z = np.where(np.arange(width)[None, :] < lengths[:, None], 0.0, -np.inf)  # (rows, width)
            z[:, 1 : 1 + TOP_K] = gap  # the top set right after the sink
            parts.append(row_stats_from_logits(z, k_max=TOP_K, seq=seq, head=head, edges=distance_edges(width),
                                               distance_alphas=DEFAULT_ALPHA_GRID))
    return RowStats.concat(parts)


@pytest.fixture(scope="module")
def stats():
    return two_level_stats()


def two_level_alpha(n, gap, mass_ref):
    """The exact correction of the two-level law: ``(n - k) exp(-a G) = k (1 - M_ref) / M_ref``."""
    return np.log((np.asarray(n, dtype=np.float64) - TOP_K) * mass_ref / (TOP_K * (1.0 - mass_ref))) / gap


@pytest.mark.parametrize("granularity", ["global", "head"])
def test_extrapolated_knots_are_the_distance_models_exact_alpha(stats, granularity):
    fit = fit_slopes(stats, n_ref=N_REF, top_k=TOP_K, granularity=granularity, bootstrap=0)
    model = fit_distance(stats, n_ref=N_REF, top_k=TOP_K)
    fixed, filled_fixed, none = tabulate(fit, n_ref=N_REF, max_n=MAX_N_TABLE)
    table, filled, out_of_reach = tabulate(fit, n_ref=N_REF, max_n=MAX_N_TABLE, distance=model)
    m = table.measured
    assert none == 0 and filled == filled_fixed and fixed.extrapolation == FIXED_SLOPE
    assert table.n == fixed.n and table.n[m:] == (512, 1024, 2048, 4096, 8192)
    values, fixed_values = np.asarray(table.alpha), np.asarray(fixed.alpha)
    np.testing.assert_array_equal(values[..., :m], fixed_values[..., :m])  # the calibrated knots are untouched
    exact = np.moveaxis(model.alpha_at(table.n[m:], granularity), 0, -1)  # (*groups, knots)
    if granularity == "global":  # a mixture of the three heads: every knot within the grid's reach
        assert table.extrapolation == DISTANCE_MODEL and out_of_reach == 0
        np.testing.assert_array_equal(values[m:], exact)
        return
    # Per head: the two-level law's closed form, each head held to its own E1 reference mass.
    mass_ref = model.mass_ref("head")[0]  # (heads,)
    want = np.stack([two_level_alpha(table.n[m:], g, r) for g, r in zip(GAPS, mass_ref)])  # (heads, knots)
    reached = want < DEFAULT_ALPHA_GRID[-1]
    assert reached[1:].all() and reached[0].tolist() == [True, True, False, False, False]  # gap 1: past 4 from 2048
    assert table.extrapolation == MIXED and out_of_reach == int((~reached).sum())
    # The model's mass is the two-level law's up to float32 statistics (~1e-7); its root is read
    # from PCHIP on the 0.025-step grid, then linearly on a 0.0025 grid: about 1e-5 in alpha.
    beyond = values[0, :, m:]  # (heads, knots)
    np.testing.assert_allclose(beyond[reached], want[reached], atol=1e-4)
    np.testing.assert_array_equal(beyond[reached], exact[0][reached])
    # Out of reach: the fixed slope's value (the two-level law is log-linear past n_ref: near the exact one).
    slope = np.asarray(fit.slopes["mass-matching"])
    held = extrapolate(np.array(table.n[m:]), table.n[m - 1], values[0, :, m - 1], slope[0])
    np.testing.assert_array_equal(beyond[~reached], held[~reached])


def test_knots_keep_the_alpha_contract(stats):
    """Extrapolated knots do not fall, and alpha is > 0 and finite in float32 at every n (``Law.bounds``)."""
    fit = fit_slopes(stats, n_ref=N_REF, top_k=TOP_K, granularity="head", bootstrap=0)
    table, _, _ = tabulate(fit, n_ref=N_REF, max_n=MAX_N_TABLE, distance=fit_distance(stats, n_ref=N_REF, top_k=TOP_K))
    m = table.measured
    spec = ScaleSpec(law="tabulated", n_ref=N_REF, slope=None, top_k=TOP_K, granularity="head", table=table)
    assert np.all(np.diff(spec.values()[..., m - 1 :], axis=-1) >= 0)
    alpha = alpha_law("tabulated", np.array([2.0, N_REF, *table.n, MAX_N])[:, None, None], n_ref=N_REF,
                      table=(table.n, spec.values()))
    assert np.all(alpha > 0) and np.all(np.isfinite(alpha.astype(np.float32)))


def _same_numbers(made, golden, path="table"):
    """Equal structure, strings and integers; floats to 1e-10 relative. The fit sums in an order
    that differs between BLAS builds and CPUs (last-digit differences, about 1e-14 relative, seen
    between machines); 1e-10 is far below any change a code edit makes to a slope or an alpha."""
    if isinstance(golden, dict):
        assert isinstance(made, dict) and made.keys() == golden.keys(), path
        for key in golden:
            _same_numbers(made[key], golden[key], f"{path}.{key}")
    elif isinstance(golden, list):
        assert isinstance(made, list) and len(made) == len(golden), path
        for i, (a, b) in enumerate(zip(made, golden)):
            _same_numbers(a, b, f"{path}[{i}]")
    elif isinstance(golden, float):
        assert made == pytest.approx(golden, rel=1e-10, abs=1e-12), path
    else:
        assert made == golden, path


def test_without_a_profile_the_table_is_todays():
    """Statistics without a distance profile: the fixed-slope table, as written before the distance
    model could extrapolate (``tests/data/tabulated_fixed_slope.json``, from the committed demo rows),
    to the last digits a change of CPU or BLAS build may move."""
    stats, _ = RowStats.load(ROOT / "notebooks" / "data" / "eagle3_demo_v1_pydoc.npz")
    assert stats.distance is None
    made = {}
    for granularity in ("global", "head"):
        fit = fit_slopes(stats, n_ref=256, top_k=TOP_K, granularity=granularity, bootstrap=0)
        table, _, out_of_reach = tabulate(fit, n_ref=256, max_n=16384)
        assert table.extrapolation == FIXED_SLOPE and out_of_reach == 0
        made[granularity] = asdict(table)
    golden = (Path(__file__).parent / "data" / "tabulated_fixed_slope.json").read_text()
    _same_numbers(json.loads(json.dumps(made)), json.loads(golden))


def test_fit_spec_records_the_extrapolation_and_inspect_reads_it(stats, tmp_path):
    info = DrafterInfo(kind="hf", path=None, num_layers=1, num_heads=len(GAPS), num_kv_heads=1, head_dim=8)
    collection = Collection(drafter="hf", drafter_path=None, target_path=None, aux_layer_reading=None,
                            drafter_info=info, corpus="synthetic", max_length=512, dtype="float32", sequences=2)
    settings = FitSettings(n_ref=N_REF, top_k=TOP_K, granularity="head", estimator="mass-matching",
                           alpha_max=None, law="tabulated", max_n=MAX_N_TABLE, bootstrap=0)
    spec, _, notes = fit_spec(stats, collection, settings)
    assert spec.table.extrapolation == MIXED
    assert any("out of the distance model's reach" in note for note in notes), notes
    jsonschema.validate(spec.to_dict(), json.loads(schema_path().read_text()))
    spec.save(tmp_path / "spec.json")
    res = CliRunner().invoke(app, ["inspect", str(tmp_path / "spec.json")], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert MIXED in res.output and f"{spec.table.measured} calibrated" in res.output

    bare, _, bare_notes = fit_spec(replace(stats, distance=None), collection, settings)
    assert bare.table.extrapolation == FIXED_SLOPE
    assert any("no distance profile" in note for note in bare_notes), bare_notes
    assert bare.table.n == spec.table.n and bare.table.alpha != spec.table.alpha


def test_measured_heads_whose_model_falls_hold_their_last_value():
    """SmolLM2-135M's 270 heads (the distance notebook's calibration file): where the model's a*(n)
    falls below the knot before it the table holds that knot's value, elsewhere it is the model's."""
    stats, _ = RowStats.load(ROOT / "notebooks" / "data" / "smollm2_distance_2048.npz")
    fit = fit_slopes(stats, n_ref=256, top_k=TOP_K, granularity="head", bootstrap=0)
    model = fit_distance(stats, n_ref=256, top_k=TOP_K)
    table, _, out_of_reach = tabulate(fit, n_ref=256, max_n=16384, distance=model)
    m = table.measured
    values = np.asarray(table.alpha)  # (layers, heads, knots)
    exact = np.moveaxis(model.alpha_at(table.n[m:], "head"), 0, -1)  # (layers, heads, extrapolated knots)
    before = values[..., m - 1 : -1]  # each extrapolated knot's predecessor in the table
    assert out_of_reach == np.count_nonzero(~np.isfinite(exact))
    rises, falls = np.isfinite(exact) & (exact >= before), np.isfinite(exact) & (exact < before)
    assert np.count_nonzero(falls) > 10  # the model does fall in real heads: holding is needed
    np.testing.assert_array_equal(values[..., m:][rises], exact[rises])
    np.testing.assert_array_equal(values[..., m:][falls], before[falls])
    assert np.all(np.diff(values[..., m - 1 :], axis=-1) >= 0)
    spec = ScaleSpec(law="tabulated", n_ref=256, slope=None, top_k=TOP_K, granularity="head", table=table)
    jsonschema.validate(spec.to_dict(), json.loads(schema_path().read_text()))
