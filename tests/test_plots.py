"""`sharpdraft plot` and the figure functions of calibrate.plots, on statistics drawn from the score model."""

import subprocess
import sys

import numpy as np
import pytest
from matplotlib.image import imread
from typer.testing import CliRunner

from calibrate import plots
from calibrate.cli import app
from sharpdraft_theory import Gaussian, TwoLevel
from sharpdraft_theory.estimators import fit_slopes
from sharpdraft_theory.stats import RowStats, row_stats_from_logits

runner = CliRunner()
N_REF, TOP_K = 128, 4


def synthetic_stats(*, layers=2, heads=3, seqs=3, n_max=1024, seed=0) -> RowStats:
    """Rows under a Gaussian score model (gap varying by layer and head), 4 lengths per octave from 32."""
    rng = np.random.default_rng(seed)
    lengths = np.unique(np.round(32 * 2.0 ** (np.arange(4 * np.log2(n_max / 32) + 1) / 4)).astype(int))
    layer, head, seq = (a.ravel() for a in np.meshgrid(np.arange(layers), np.arange(heads), np.arange(seqs),
                                                       indexing="ij"))
    gap = 5.0 + layer + 0.5 * head  # (rows,)
    parts = []
    for n in lengths:
        logits = rng.normal(0.0, 1.0, size=(layer.size, n))  # (rows, n): background N(0, 1)
        logits[:, :TOP_K] = gap[:, None]  # planted top set
        parts.append(row_stats_from_logits(logits, k_max=8, layer=layer, head=head, seq=seq))
    return RowStats.concat(parts)


@pytest.fixture(scope="module")
def stats_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("stats") / "synthetic.npz"
    synthetic_stats().save(path, n_ref=N_REF, top_k=TOP_K, drafter="synthetic")
    return path


@pytest.fixture(scope="module")
def loaded(stats_file):
    stats, meta, n_ref, top_k = plots.load_stats(stats_file)
    return stats, meta, n_ref, top_k


def run_main(*args):
    """The console script's entry point in a subprocess: exit code and stderr as a user sees them."""
    return subprocess.run([sys.executable, "-c", "from calibrate.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=300)


def assert_readable(fig):
    """Every data axes has both labels; every axes over n is log-scale; titled; legend or colour bar."""
    data_axes = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert data_axes
    for ax in data_axes:
        assert ax.get_xlabel() and ax.get_ylabel(), f"unlabelled axes: {ax.get_title()!r}"
        if "visible keys n" in ax.get_xlabel():
            assert ax.get_xscale() == "log"
    assert fig.get_suptitle() or any(ax.get_title() for ax in data_axes)
    assert any(ax.get_legend() is not None for ax in data_axes) or len(fig.axes) > len(data_axes)


def test_plot_command_writes_the_standard_pngs(stats_file, tmp_path):
    res = runner.invoke(app, ["plot", str(stats_file), "--out", str(tmp_path / "fig"), "--bootstrap", "10"])
    assert res.exit_code == 0, res.output
    for name in plots.STANDARD_FIGURES:
        path = tmp_path / "fig" / name
        assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width = imread(path).shape[:2]
        assert width >= 600 and height >= 350  # big enough to read
        assert f"wrote {path}" in res.output
    assert not [p for p in (tmp_path / "fig").iterdir() if p.name.startswith(".")]  # no temporary left


def test_standard_figures_are_readable(loaded):
    stats, _, n_ref, top_k = loaded
    fit = fit_slopes(stats, n_ref=n_ref, top_k=top_k, granularity="head", bootstrap=10)
    dilution = plots.measured_dilution_figure(stats, fit, n_ref=n_ref, top_k=top_k)
    alpha = plots.alpha_figure(fit, n_ref=n_ref)
    heatmap = plots.slope_heatmap_figure(fit)
    for fig in (dilution, alpha, heatmap):
        assert_readable(fig)
    assert all(ax.get_xscale() == "log" for ax in dilution.axes + alpha.axes)
    assert len(heatmap.axes) == 4  # three estimators and the colour bar
    labels = [t.get_text() for t in alpha.axes[0].get_legend().get_texts()]
    assert any(t.startswith("E1 mass matching: beta = ") for t in labels)


def test_report_figures_are_readable(loaded):
    stats, _, n_ref, top_k = loaded
    fit = fit_slopes(stats, n_ref=n_ref, top_k=top_k, bootstrap=10)
    fit_layer = fit_slopes(stats, n_ref=n_ref, top_k=top_k, granularity="layer", bootstrap=0)
    fit_head = fit_slopes(stats, n_ref=n_ref, top_k=top_k, granularity="head", bootstrap=0)
    assert_readable(plots.estimator_figure(fit_layer, fit_head, fit_global=fit))
    diag = plots.layer_diagnostics(stats, n_ref=n_ref, top_k=top_k)
    assert_readable(plots.assumption_figure(stats, diag, n_ref=n_ref, top_k=top_k))
    # Rows drawn from the model satisfy its assumptions: gamma near 1, no failure flagged for A2.
    np.testing.assert_allclose(diag.gamma, 1.0, atol=0.1)
    assert "|gamma - 1| > 0.25: none" in plots.format_failures(diag)
    table = plots.dilution_table(stats, fit, n_ref=n_ref, top_k=top_k)
    assert table and all(r["n"] > n_ref / 2 for r in table)
    assert "E1 mass matching" in plots.format_results(fit)


def test_theory_figures_are_readable():
    models = {"D = 6": Gaussian(gap=6.0, sigma=1.0, top_k=4), "two-level": TwoLevel(gap=6.0, top_k=4)}
    assert_readable(plots.dilution_law_figure({"gap": models}, n_ref=512, n_max=1 << 16))
    assert_readable(plots.quenched_figure({"sigma 3": Gaussian(gap=12.0, sigma=3.0, top_k=4)}, n=[64, 1024], rows=8))
    fig = plots.correction_figure(Gaussian(gap=6.0, sigma=1.0, top_k=4), n_ref=512, n_max=1 << 20,
                                  mc_n=[4096], mc_rows=8)
    assert_readable(fig)
    assert any("correction horizon" not in t.get_text() for t in fig.axes[0].get_legend().get_texts())
    assert_readable(plots.horizon_figure([6.0], np.linspace(0.5, 2.4, 8), top_k=4, n_ref=512, n_max=1 << 17))


def test_horizon_is_drawn_when_inside_the_range():
    fig = plots.correction_figure(Gaussian(gap=4.0, sigma=1.2, top_k=4), n_ref=512, n_max=1 << 20)
    texts = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any(t.startswith("correction horizon n = ") for t in texts)


def _pngs(folder):
    return [(folder / name).read_bytes() for name in plots.STANDARD_FIGURES]


def test_n_ref_and_top_k_from_options_override_the_file(stats_file, tmp_path):
    """Options beat the stored n_ref = 128, top_k = 4: the figures equal those of a file storing 256 and 2."""
    stored = tmp_path / "stored" / stats_file.name  # same name and drafter: same figure titles
    stored.parent.mkdir()
    RowStats.load(stats_file)[0].save(stored, n_ref=256, top_k=2, drafter="synthetic")
    runs = {"override": [str(stats_file), "--n-ref", "256", "--top-k", "2"], "stored": [str(stored)],
            "plain": [str(stats_file)]}
    for name, args in runs.items():
        res = runner.invoke(app, ["plot", *args, "--out", str(tmp_path / name), "--bootstrap", "0"])
        assert res.exit_code == 0, res.output
    assert _pngs(tmp_path / "override") == _pngs(tmp_path / "stored")
    # this test can fail: without the options every figure is drawn at n_ref = 128, top_k = 4
    assert all(a != b for a, b in zip(_pngs(tmp_path / "override"), _pngs(tmp_path / "plain")))


def test_a_file_without_metadata_plots_with_the_options(stats_file, tmp_path):
    bare = tmp_path / "bare.npz"  # as calibration wrote them before it stored its settings
    RowStats.load(stats_file)[0].save(bare)
    res = runner.invoke(app, ["plot", str(bare), "--out", str(tmp_path / "fig"), "--n-ref", str(N_REF),
                              "--bootstrap", "0"])
    assert res.exit_code == 0, res.output
    assert all(png[:8] == b"\x89PNG\r\n\x1a\n" for png in _pngs(tmp_path / "fig"))


@pytest.mark.parametrize("args,message", [
    (["{nometa}"], "does not store n_ref; pass --n-ref"),
    (["{file}", "--top-k", "9"], "--top-k 9 must be between 1 and 8"),
    (["{file}", "--n-ref", "1024"], "--n-ref 1024: no rows with n > n_ref=1024"),
    (["missing.npz"], "statistics file 'missing.npz' does not exist"),
])
def test_bad_input_is_one_line_exit_1(args, message, stats_file, tmp_path):
    nometa = tmp_path / "nometa.npz"
    RowStats.load(stats_file)[0].save(nometa)
    res = run_main("plot", *[a.format(file=stats_file, nometa=nometa) for a in args], "--out", str(tmp_path / "o"))
    assert res.returncode == 1
    assert message in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
