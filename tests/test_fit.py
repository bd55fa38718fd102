"""``sharpdraft fit``: a spec from saved statistics, the same one calibration wrote; files merged or refused."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.errors import UserError
from calibrate.fit import fit_files, read_record, record_meta
from calibrate.run import CalibrateOptions, run_calibration
from sharpdraft_theory.spec import ScaleSpec
from sharpdraft_theory.stats import RowStats
from test_calibrate import _write_causal_lm


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Statistics files of tiny calibrations: pard on two corpora, hf on one; and pard's spec."""
    root = tmp_path_factory.mktemp("fit")
    pard = _write_causal_lm(root / "pard", pard_token=258, spd_type="pard")
    bare = _write_causal_lm(root / "bare", tokenizer=False)
    base = dict(drafter="pard", drafter_path=str(pard), max_length=256, sequences=3, n_ref=64, device="cpu",
                bootstrap=20)
    out = {}
    for name, kw in {"train": {}, "heldout": dict(corpus="pydoc:heldout", sequences=2),
                     "hf": dict(drafter="hf", drafter_path=str(bare), target_path=str(pard))}.items():
        opts = CalibrateOptions(**{**base, **kw, "out": root / f"{name}.json", "stats": root / f"{name}.npz"})
        run_calibration(opts)
        out[name] = opts.out.with_suffix(".npz")
    out["spec"] = root / "train.json"
    return out


def _fit(*args):
    return CliRunner().invoke(app, ["fit", *map(str, args)], terminal_width=200)


def test_fit_reproduces_the_calibration_spec_byte_for_byte(runs, tmp_path):
    res = _fit(runs["train"], "--out", tmp_path / "fit.json")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "fit.json").read_text() == runs["spec"].read_text()
    assert "mass-matching" in res.output and "95% interval" in res.output


def test_fit_options_override_the_recorded_ones(runs, tmp_path):
    res = _fit(runs["train"], "--out", tmp_path / "fit.json", "--n-ref", "96", "--estimator", "E3",
               "--granularity", "layer", "--alpha-max", "2.5")
    assert res.exit_code == 0, res.output
    spec, calibrated = ScaleSpec.load(tmp_path / "fit.json"), ScaleSpec.load(runs["spec"])
    assert (spec.n_ref, spec.calibration.estimator, spec.granularity, spec.alpha_max) == (96, "gaussian", "layer", 2.5)
    assert spec.slopes().shape == (2,) and spec.drafter == calibrated.drafter
    with pytest.raises(UserError, match="top_k=17 must be between 1 and k_max=16"):
        fit_files([runs["train"]], top_k=17)
    with pytest.raises(UserError, match="--granularity row"):
        fit_files([runs["train"]], granularity="row")
    with pytest.raises(UserError, match="--top-k 4: must be below --n-ref 4"):
        fit_files([runs["train"]], n_ref=4)


def test_fit_tabulates_like_calibrate(runs, tmp_path):
    """The tabulated law from the same rows: the spec of calibrate --law tabulated, byte for byte."""
    pard = ScaleSpec.load(runs["spec"]).drafter.path
    opts = CalibrateOptions(out=tmp_path / "table.json", stats=tmp_path / "table.npz", drafter="pard",
                            drafter_path=pard, max_length=256, sequences=3, n_ref=64, device="cpu", bootstrap=20,
                            law="tabulated", max_n=1024)
    run_calibration(opts)
    res = _fit(opts.stats, "--out", tmp_path / "fit.json")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "fit.json").read_text() == opts.out.read_text()
    spec = fit_files([runs["train"]], law="tabulated")[0]  # a log-linear calibration's rows, tabulated
    assert spec.law == "tabulated" and spec.table.n[-1] == 64 * 64
    with pytest.raises(UserError, match="--estimator gaussian with --law tabulated"):
        fit_files([runs["train"]], law="tabulated", estimator="gaussian")


def test_fit_joins_corpora_keeping_their_sequences_apart(runs, tmp_path):
    spec, _, stats, _ = fit_files([runs["train"], runs["heldout"]])
    train, _, _ = read_record(runs["train"])
    heldout, _, _ = read_record(runs["heldout"])
    assert stats.rows == train.rows + heldout.rows
    assert sorted(set(stats.seq.tolist())) == [0, 1, 2, 3, 4]  # 3 + 2 sequences, none shared
    assert spec.calibration.corpus == "pydoc + pydoc:heldout" and spec.calibration.sequences == 5
    assert spec.calibration.rows == stats.rows
    # the distance profile follows: one entry per sequence, the later file's shifted with its rows
    assert stats.distance.seq.tolist() == [0, 1, 2, 3, 4]
    for name in ("weight", "keys", "sink", "rows"):
        np.testing.assert_array_equal(getattr(stats.distance, name),
                                      np.concatenate([getattr(train.distance, name), getattr(heldout.distance, name)]))


def test_fit_notes_a_file_without_distance_statistics(runs, tmp_path):
    heldout, collection, settings = read_record(runs["heldout"])
    bare = tmp_path / "bare.npz"
    replace(heldout, distance=None).save(bare, **record_meta(collection, settings))
    spec, _, stats, notes = fit_files([runs["train"], bare])
    assert stats.distance is None and stats.rows == read_record(runs["train"])[0].rows + heldout.rows
    assert any(f"{bare} holds no distance statistics" in note for note in notes), notes


def test_fit_refuses_files_of_two_drafters(runs, tmp_path):
    res = _fit(runs["train"], runs["hf"], "--out", tmp_path / "fit.json")
    assert res.exit_code == 1 and not (tmp_path / "fit.json").exists()
    assert isinstance(res.exception, UserError)  # main() prints it as one line
    assert "were collected with different drafter ('pard' and 'hf')" in str(res.exception)


def test_fit_refuses_the_same_corpus_twice(runs):
    with pytest.raises(UserError, match="both hold the leading sequences of corpus pydoc at max_length 256"):
        fit_files([runs["train"], runs["train"]])


def _rewrite(src, dst, *, grid_step=1, **record):
    """A copy of a statistics file with its alpha grid thinned and record fields replaced."""
    stats, collection, settings = read_record(src)
    cols = np.arange(0, stats.alpha_grid.size, grid_step)
    stats = replace(stats, alpha_grid=stats.alpha_grid[cols], lse=stats.lse[:, cols])
    collection = replace(collection, **{k: v for k, v in record.items() if hasattr(collection, k)})
    settings = replace(settings, **{k: v for k, v in record.items() if hasattr(settings, k)})
    stats.save(dst, **record_meta(collection, settings))
    return dst


def test_fit_refuses_other_alpha_grids_and_asks_for_disputed_settings(runs, tmp_path):
    thin = _rewrite(runs["heldout"], tmp_path / "thin.npz", grid_step=2)
    with pytest.raises(UserError, match=r"different alpha grids \(101 values 0.5..4 and 51 values 0.5..4\)"):
        fit_files([runs["train"], thin])
    other_ref = _rewrite(runs["heldout"], tmp_path / "ref.npz", n_ref=96)
    with pytest.raises(UserError, match=r"fitted with different n_ref \(64, 96\): pass --n-ref"):
        fit_files([runs["train"], other_ref])
    assert fit_files([runs["train"], other_ref], n_ref=80)[0].n_ref == 80
    longer = _rewrite(runs["heldout"], tmp_path / "long.npz", max_length=512)
    with pytest.raises(UserError, match="different max_length"):
        fit_files([runs["train"], longer])


def test_fit_never_writes_over_its_input(runs, tmp_path):
    copy = tmp_path / "copy.npz"
    copy.write_bytes(runs["train"].read_bytes())
    res = _fit(copy, "--out", copy)
    assert res.exit_code == 1 and "is the statistics file" in str(res.exception)
    assert copy.read_bytes() == runs["train"].read_bytes()


def test_fit_needs_the_record(runs, tmp_path):
    stats, _, _ = read_record(runs["train"])
    stats.save(tmp_path / "bare.npz")
    res = _fit(tmp_path / "bare.npz", "--out", tmp_path / "fit.json")
    assert res.exit_code == 1 and "no record of drafter" in str(res.exception)
    with pytest.raises(UserError, match="does not exist"):
        fit_files([tmp_path / "missing.npz"])
    assert RowStats.load(runs["train"])[1]["drafter_info"].startswith("{")
