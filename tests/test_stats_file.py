"""The statistics file records what it was made with: ``calibrate --stats`` then ``plot`` with no options."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from tiny_checkpoints import tiny_target
from calibrate.plots import STANDARD_FIGURES, load_stats
from sharpdraft_theory import __version__
from sharpdraft_theory.stats import RowStats, distance_edges, row_stats_from_logits
from test_calibrate import VOCAB, _write_tokenizer
from test_cli_theory import run_main

runner = CliRunner()


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A tiny random Llama calibrated through the command line: (checkpoint folder, statistics file)."""
    root = tmp_path_factory.mktemp("tiny")
    tiny_target(0, num_layers=2, vocab_size=VOCAB).save_pretrained(root / "drafter")
    _write_tokenizer(root / "drafter")
    stats = root / "S.npz"
    res = runner.invoke(app, ["calibrate", "--drafter", "hf", "--drafter-path", str(root / "drafter"), "--n-ref", "64",
                              "--max-length", "256", "--sequences", "2", "--top-k", "3", "--granularity", "layer",
                              "--device", "cpu", "--stats", str(stats), "--out", str(root / "spec.json")])
    assert res.exit_code == 0, res.output
    return root / "drafter", stats


def test_calibration_stores_its_settings(calibrated):
    drafter, path = calibrated
    stats, meta, n_ref, top_k = load_stats(path)
    assert (n_ref, top_k) == (64, 3)
    shape = {"kind": "hf", "path": str(drafter), "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}
    assert meta == {"drafter": "hf", "drafter_path": str(drafter), "target_path": None, "aux_layer_reading": None,
                    "drafter_info": shape, "corpus": "pydoc", "max_length": 256, "dtype": "float32", "sequences": 2,
                    "trained_window": 4096, "n_ref": 64, "top_k": 3, "granularity": "layer", "estimator": "mass-matching", "alpha_max": None,
                    "law": "log-linear", "max_n": None,
                    "bootstrap": 200, "tool_version": __version__}
    assert stats.k_max >= 3 and 1.0 in stats.alpha_grid  # the grids are the arrays' own, not repeated in meta


def test_plot_reads_the_settings_from_the_file(calibrated, tmp_path):
    _, path = calibrated
    res = runner.invoke(app, ["plot", str(path), "--out", str(tmp_path / "plain")])
    assert res.exit_code == 0, res.output
    for name in STANDARD_FIGURES:
        assert (tmp_path / "plain" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the same figures as with the stored settings spelled out
    res = runner.invoke(app, ["plot", str(path), "--out", str(tmp_path / "spelled"), "--n-ref", "64", "--top-k", "3"])
    assert res.exit_code == 0, res.output
    for name in STANDARD_FIGURES:
        assert (tmp_path / "plain" / name).read_bytes() == (tmp_path / "spelled" / name).read_bytes()


def test_calibration_stores_the_distance_profile(calibrated):
    _, path = calibrated
    stats, *_ = load_stats(path)
    dist = stats.distance
    assert dist is not None and dist.seq.tolist() == [0, 1]
    assert dist.rows.shape == (2, 2, stats.head.max() + 1)
    # every grid row of every layer and head is in the sums, and its distances fill the bins up to n - 1
    assert np.all(dist.rows == np.unique(stats.n).size)
    n = stats.n[(stats.seq == 0) & (stats.layer == 0) & (stats.head == 0)]
    # n - 1 - k_max background keys per row (sink and top set out), one more where the sink is in the top set
    assert np.sum(n - 1 - stats.k_max) <= dist.keys.sum(axis=-1)[0, 0, 0] <= np.sum(n - stats.k_max)
    assert np.all((dist.sink >= 0) & (dist.sink <= dist.rows[..., None]))


def test_joining_separate_runs_shifts_the_profile_with_its_rows():
    z = np.random.default_rng(0).normal(size=(4, 40))
    run = row_stats_from_logits(z, k_max=2, seq=[0, 0, 1, 1], edges=distance_edges(40))
    joined = RowStats.concat([run, run], separate_runs=True)
    assert joined.distance.seq.tolist() == [0, 1, 2, 3] and joined.seq.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    np.testing.assert_array_equal(joined.distance.weight[2:], run.distance.weight)
    # select keeps the profile whole (sequences 0 and 1): the next run starts past both
    late = RowStats.concat([run.select(run.seq == 1), run], separate_runs=True)
    assert late.distance.seq.tolist() == [0, 1, 2, 3] and late.seq.tolist() == [1, 1, 2, 2, 3, 3]
    np.testing.assert_array_equal(late.distance.weight, joined.distance.weight)
    without = row_stats_from_logits(z, k_max=2, seq=[0, 0, 1, 1])
    assert RowStats.concat([run, without], separate_runs=True).distance is None  # only some parts hold a profile


def test_one_run_split_across_parts_keeps_one_profile_per_sequence():
    rng = np.random.default_rng(2)
    z, layer = rng.normal(size=(6, 40)), [0, 1, 0, 1, 0, 1]
    whole = row_stats_from_logits(z, k_max=2, seq=[0, 0, 1, 1, 2, 2], layer=layer, edges=distance_edges(40))
    parts = [row_stats_from_logits(z[i::2], k_max=2, seq=[0, 1, 2], layer=i, edges=distance_edges(40))
             for i in (0, 1)]  # the same sequences, one file per layer
    joined = RowStats.concat(parts)
    assert joined.distance.seq.tolist() == whole.distance.seq.tolist() == [0, 1, 2]
    for name in ("weight", "keys", "sink", "rows"):
        np.testing.assert_allclose(getattr(joined.distance, name), getattr(whole.distance, name), rtol=1e-12,
                                   err_msg=name)  # the same float64 sums, added in another order


def test_distance_profile_survives_save_and_load(tmp_path):
    z = np.random.default_rng(1).normal(size=(3, 50))
    stats = row_stats_from_logits(z, k_max=4, edges=distance_edges(50))
    stats.save(tmp_path / "s.npz")
    back, _ = RowStats.load(tmp_path / "s.npz")
    for name in ("seq", "alpha", "edges", "weight", "keys", "sink", "rows"):
        np.testing.assert_array_equal(getattr(back.distance, name), getattr(stats.distance, name))
    assert back.select(back.n > 0).distance is back.distance


def test_predict_from_the_statistics_file(calibrated):
    _, path = calibrated
    res = runner.invoke(app, ["predict", "--stats", str(path), "--n", "256", "--n", "2048", "--bootstrap", "10",
                              "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert (out["n_ref"], out["top_k"], out["longest_calibrated_n"], out["sequences"]) == (64, 3, 256, 2)
    assert [r["n"] for r in out["rows"]] == [256, 2048] and [r["extrapolated"] for r in out["rows"]] == [False, True]
    for row in out["rows"]:
        for key in ("mass_unscaled", "mass_power_law", "mass_iid"):
            assert 0 < row[key] < 1
    far = out["rows"][1]
    assert far["mass_iid"] < out["rows"][0]["mass_iid"] and far["mass_unscaled"] < out["rows"][0]["mass_unscaled"]
    res = runner.invoke(app, ["predict", "--stats", str(path), "--n", "2048", "--bootstrap", "0"])
    assert res.exit_code == 0 and "distance model" in res.output.lower()


@pytest.mark.parametrize("args, message", [
    (["--tail", "cubic"], "--tail 'cubic'"),
    (["--bootstrap", "-1"], "--bootstrap -1"),
    (["--n", "2"], "--n 2: must be at least --n-ref 64"),
    (["--gap", "5"], "--gap describes a score model"),
    (["--mc-rows", "10"], "--mc-rows describes a score model"),
    (["--top-k", "99"], "99"),
])
def test_predict_from_statistics_refuses_bad_values(calibrated, args, message):
    _, path = calibrated
    res = run_main("predict", "--stats", str(path), *args)
    assert res.returncode == 1
    assert message in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_predict_refuses_a_missing_statistics_file(tmp_path):
    res = run_main("predict", "--stats", str(tmp_path / "none.npz"))
    assert res.returncode == 1 and "does not exist" in res.stderr
