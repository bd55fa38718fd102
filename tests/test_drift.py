"""Dilution or distance drift (docs/theory.md section 8): the decomposition and verdict on synthetic rows built to
be pure dilution, pure drift, both or neither; through the library, the spec record, ``sharpdraft plot`` and
calibrate's summary."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from matplotlib.image import imread
from typer.testing import CliRunner

from calibrate.calibrate_cmd import console, print_fit
from calibrate.cli import app
from calibrate.fit import Collection, FitSettings, fit_spec
from sharpdraft_theory.distance import fit_distance
from sharpdraft_theory.drift import LEVEL_THRESHOLD, Verdict, continued_profiles, decompose, verdict
from sharpdraft_theory.spec import DrafterInfo, ScaleSpec, SpecError, schema_path
from sharpdraft_theory.stats import RowStats, distance_edges, row_stats_from_logits

pytestmark = pytest.mark.usefixtures("one_thread")
runner = CliRunner()

W = 128  # seen window = n_ref of the synthetic drafters
N_MAX = 1024
LENGTHS = (72, 90, 100, 110, 128, 181, 256, 362, 512, 724, 1024)
SEQUENCES, HEADS, ROWS = 6, 2, 2  # rows per (sequence, head, length)


def synthetic(kind: str, seed: int = 0) -> RowStats:
    """Rows of ``n`` keys whose logit depends on the key's distance ``d = n - j`` as ``kind`` says.

    * ``dilution``: i.i.d. N(0, 1), distance-free: more keys, scored alike at every distance;
    * ``distance``: steep decay ``-3 ln d`` (the background converges: more keys add nothing) at
      ``d <= W``, and a jump of every key past ``W`` to ``-3 ln W + 8``: the unseen distances;
    * ``both``: i.i.d. at ``d <= W``, the jump (+3) past it;
    * ``neither``: the steep decay at every distance.
    """
    rng = np.random.default_rng(seed)
    z, n_of, seq, head = [], [], [], []
    for s in range(SEQUENCES):
        for h in range(HEADS):
            for n in LENGTHS:
                for _ in range(ROWS):
                    d = n - np.arange(n)  # key j at distance n - j; the sink at d = n
                    noise = rng.normal(size=n)
                    if kind == "dilution":
                        row = noise
                    elif kind == "both":
                        row = noise + np.where(d > W, 3.0, 0.0)
                    else:
                        row = -3.0 * np.log(d) + 0.3 * noise
                        if kind == "distance":
                            row = np.where(d > W, -3.0 * np.log(W) + 8.0 + 0.3 * noise, row)
                    z.append(np.concatenate([row, np.full(N_MAX - n, -np.inf)]))
                    n_of.append(n), seq.append(s), head.append(h)
    return row_stats_from_logits(np.array(z), k_max=4, seq=seq, head=head, edges=distance_edges(N_MAX))


@pytest.fixture(scope="module")
def cases():
    return {kind: synthetic(kind) for kind in ("dilution", "distance", "both", "neither")}


def _verdict(stats, window=W, bootstrap=20):
    return verdict(fit_distance(stats, n_ref=W, top_k=4), window=window, bootstrap=bootstrap)


@pytest.mark.parametrize("kind", ["dilution", "distance", "both", "neither"])
def test_verdict_names_what_the_rows_were_built_with(cases, kind):
    v = _verdict(cases[kind])
    assert v.verdict == kind, v.line()
    assert v.n == N_MAX and v.window == W and v.heads == HEADS and v.note is None
    if kind in ("distance", "both"):  # every head drifts, by far more than the threshold
        # (a jump of +3 reads as less than 3 nats: far keys raise the long rows' largest logit, the weights' reference)
        assert v.level_low > 1.0 and v.heads_drift == HEADS and v.drift > 0.05
    else:  # the far profile is its continuation: the level is 0 up to sampling and the tail fit
        assert abs(v.level) < 0.15 and v.heads_drift == 0 and abs(v.drift) < 0.01
    if kind in ("dilution", "both"):  # i.i.d. seen keys: the top-4 mass dilutes from ~0.2 to ~0.05
        assert v.dilution_low > 0.08 and v.heads_dilution == HEADS
    else:  # sum of d^-3 past W: ~3e-5 of the background, nothing to dilute
        assert abs(v.dilution) < 0.005 and v.heads_dilution == 0


def test_decomposition_parts_add_up(cases):
    """M_ref - M_m(1; n) = dilution + drift, exactly (the two differences telescope)."""
    fit = fit_distance(cases["both"], n_ref=W, top_k=4)
    g, h = decompose(fit, window=W, granularity=("global", "head"), bootstrap=0)
    one = int(np.argmin(np.abs(g.alpha - 1.0)))
    np.testing.assert_allclose(g.value("dilution") + g.value("drift"), g.mass_ref - g.mass_measured[one], rtol=1e-12)
    # the global mass is the mean over all anchor rows: heads hold as many rows, so it is their plain mean
    np.testing.assert_allclose(g.mass_continued, h.mass_continued.mean(axis=(0, 1)), rtol=1e-12)
    # a larger scale raises the mass under either profile (Fact 1 holds row by row)
    assert np.all(np.diff(g.mass_continued) >= -1e-12) and np.all(np.diff(g.mass_measured) >= -1e-12)
    assert np.isnan(g.low("level")) and g.tested  # no bootstrap: no interval


def test_no_distance_past_the_window_judges_dilution_only(cases):
    v = _verdict(cases["distance"], window=N_MAX)
    assert v.drift is None and v.level is None and v.heads_drift == 0
    assert "drift is not judged" in v.note
    assert v.verdict in ("dilution", "neither")


def test_bad_requests_are_one_clear_line(cases):
    fit = fit_distance(cases["dilution"], n_ref=W, top_k=4)
    with pytest.raises(ValueError, match="past n_ref = 128 within the measured rows"):
        decompose(fit, window=W, n=4096)
    with pytest.raises(ValueError, match="fewer than two bins of seen distances"):
        continued_profiles(fit, 1)
    short = cases["dilution"].select(cases["dilution"].n >= 128)
    with pytest.raises(ValueError, match=r"no measured rows with n in \(71, 100\]"):
        decompose(fit_distance(short, n_ref=W, top_k=4), window=100)


def _fit(stats, trained_window=None, bootstrap=20):
    collection = Collection(drafter="hf", drafter_path=None, target_path=None, aux_layer_reading=None,
                            drafter_info=DrafterInfo(kind="hf", path=None, num_layers=1, num_heads=HEADS,
                                                     num_kv_heads=HEADS, head_dim=8),
                            corpus="synthetic", max_length=N_MAX, dtype="float32", sequences=SEQUENCES,
                            trained_window=trained_window)
    settings = FitSettings(n_ref=W, top_k=4, granularity="global", estimator="mass-matching", alpha_max=None,
                           bootstrap=bootstrap)
    return fit_spec(stats, collection, settings)


@pytest.mark.parametrize("kind", ["dilution", "distance"])
def test_the_spec_records_the_verdict_and_the_summary_prints_it(tmp_path, cases, kind):
    spec, fit, notes = _fit(cases[kind])
    assert spec.calibration.verdict.verdict == kind
    spec.save(tmp_path / "s.json")
    loaded = ScaleSpec.load(tmp_path / "s.json")
    assert loaded == spec and isinstance(loaded.calibration.verdict, Verdict)
    record = json.loads((tmp_path / "s.json").read_text())
    jsonschema.validate(record, json.loads(schema_path().read_text()))
    assert record["calibration"]["verdict"]["level_threshold"] == pytest.approx(LEVEL_THRESHOLD)
    with console.capture() as captured:
        print_fit(spec, fit, tmp_path / "s.json")
    text = " ".join(captured.get().split())  # the console wraps at its width
    assert f"verdict {kind}," in text and "seen distances d <= 128" in text and "far-key level" in text


def test_spec_without_a_profile_has_no_verdict_and_bad_records_are_refused(tmp_path, cases):
    bare = cases["dilution"]
    bare = RowStats(**{**{f: getattr(bare, f) for f in ("n", "layer", "head", "seq", "top", "alpha_grid", "lse",
                                                         "tilted_mean", "mean", "var")}, "distance": None})
    spec, _, notes = _fit(bare)
    assert spec.calibration.verdict is None and not any("verdict" in n for n in notes)
    spec, _, _ = _fit(cases["distance"])
    record = json.loads(spec.to_json())
    record["calibration"]["verdict"]["verdict"] = "window"
    with pytest.raises(SpecError, match=r"calibration\.verdict\.verdict.*dilution, distance, both, neither"):
        ScaleSpec.from_dict(record)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(record, json.loads(schema_path().read_text()))
    record["calibration"]["verdict"]["verdict"] = "distance"
    record["calibration"]["verdict"]["mass_ref"] = 1.5
    with pytest.raises(SpecError, match=r"calibration\.verdict\.mass_ref"):
        ScaleSpec.from_dict(record)
    old = json.loads(spec.to_json())
    del old["calibration"]["verdict"]  # specs written before the verdict existed still load
    assert ScaleSpec.from_dict(old).calibration.verdict is None


def test_the_trained_window_moves_the_seen_range(cases):
    """A head trained on every distance measured: drift is not judged (the long-trained reference's case)."""
    spec, _, _ = _fit(cases["distance"], trained_window=8192)
    v = spec.calibration.verdict
    assert v.window == 8192 and v.drift is None and "not judged" in v.note


@pytest.mark.parametrize("kind", ["dilution", "distance"])
def test_plot_writes_the_drift_figure_and_prints_the_verdict(tmp_path, cases, kind):
    path = tmp_path / f"{kind}.npz"
    cases[kind].save(path, n_ref=json.dumps(W), top_k=json.dumps(4))
    res = runner.invoke(app, ["plot", str(path), "--out", str(tmp_path / "fig"), "--bootstrap", "20"],
                        terminal_width=250)
    assert res.exit_code == 0, res.output
    assert f"verdict {kind}:" in res.output
    image = imread(tmp_path / "fig" / "drift.png")
    assert image.shape[0] > 300 and image.shape[1] > 900 and image[..., :3].std() > 0.05
    res = runner.invoke(app, ["plot", str(path), "--out", str(tmp_path / "fig2"), "--bootstrap", "0",
                              "--trained-window", str(N_MAX)], terminal_width=250)
    assert res.exit_code == 0 and "drift is not judged" in res.output, res.output


def test_plot_of_a_file_without_a_profile_says_so(tmp_path):
    src = Path(__file__).parents[1] / "notebooks" / "data" / "smollm2_pydoc.npz"
    res = runner.invoke(app, ["plot", str(src), "--out", str(tmp_path), "--bootstrap", "0"], terminal_width=250)
    assert res.exit_code == 0, res.output
    assert "holds no distance profile: drift.png and the dilution/drift verdict skipped" in res.output
    assert not (tmp_path / "drift.png").exists() and "Traceback" not in res.output
