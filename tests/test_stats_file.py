"""The statistics file records what it was made with: ``calibrate --stats`` then ``plot`` with no options."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from tiny_checkpoints import tiny_target
from calibrate.plots import STANDARD_FIGURES, load_stats
from sharpdraft_theory import __version__
from test_calibrate import VOCAB, _write_tokenizer

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
                    "n_ref": 64, "top_k": 3, "granularity": "layer", "estimator": "mass-matching", "alpha_max": None,
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
