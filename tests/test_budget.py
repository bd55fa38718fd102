"""The attention budget (sink / local / far mass at alpha = 1): calibration against float64 softmax weights,
the statistics file, ``sharpdraft fit`` and ``sharpdraft plot``'s budget.png."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from matplotlib.image import imread
from typer.testing import CliRunner

from calibrate import plots
from calibrate.cli import app
from calibrate.collect import RowCollector, reduce_rows
from calibrate.fit import fit_files
from calibrate.taps import attention_tap
from sharpdraft_theory.stats import (DEFAULT_ALPHA_GRID, DEFAULT_SINKS, AttentionBudget, RowStats, budget_from_logits,
                                     row_stats_from_logits)
from test_calibrate import VOCAB, _write_tokenizer
from tiny_checkpoints import tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")
runner = CliRunner()

# Tolerances on shares (fractions of a row's mass, in [0, 1]) against float64 softmax weights of the
# same query and key values. Reasons:
#  sink, local: fp32 exponentials of fp32 logits (|z| up to ~15 here: ~1e-6 relative each), summed in
#       float64 and divided by S(1), itself a sum of fp32 exp2 products (a few ulp each).
#  far: S(1) - sink - local, so the same errors land on it absolutely: ~1e-7 of the row's mass.
SHARE_ATOL = 2e-6
# Against the model's own eager attention probabilities, an fp32 softmax of logits that fp32 matrix
# products computed in another order: ~1e-6 relative per weight, summed over at most 40 keys.
EAGER_ATOL = 2e-5

WINDOW = 8
GRID = np.array([2, 3, 4, 5, 8, 12, 13, 20, 40])  # n < S, n = S, S < n <= S + W, n > S + W (S = 4, W = 8)


def _shares(p: np.ndarray, n: int, sinks: int, window: int) -> np.ndarray:
    """The definition by slices of one row's softmax weights ``p`` over its first ``n`` keys."""
    cut = max(sinks, n - window)  # local keys start here (never among the sinks)
    return np.array([p[:min(sinks, n)].sum(), p[cut:n].sum(), p[sinks:cut].sum()])


def _model():
    model = tiny_target(0, num_layers=2)
    for p in model.parameters():  # larger weights: peaked attention, logits of several units
        p.data.mul_(3)
    return model


def _collect(model, ids, **kw):
    collector = RowCollector(GRID, k_max=1, budget_window=WINDOW)
    collector.start(0)
    with torch.no_grad(), attention_tap(model, collector):
        model(ids, **kw)
    return collector.take()


def test_budget_matches_float64_softmax_weights_of_a_tiny_model():
    model = _model()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    captured = {}

    def keep(layer, q, k, s, n):
        captured[layer] = (q[0].double(), k[0].double(), s)  # (H, T, D), (KVH, T, D)

    with torch.no_grad(), attention_tap(model, keep):
        model(ids)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = [a[0].double().numpy() for a in model(ids, output_attentions=True).attentions]  # (H, T, T) per layer
    model.set_attn_implementation("sdpa")
    stats = _collect(model, ids)
    budget = stats.budget
    assert (budget.sinks, budget.window) == (DEFAULT_SINKS, WINDOW) and budget.rows == stats.rows == 2 * 4 * GRID.size
    assert budget.share.dtype == np.float32
    for r in range(stats.rows):
        layer, head, n = int(stats.layer[r]), int(stats.head[r]), int(stats.n[r])
        q, k, scaling = captured[layer]
        z = scaling * (k[head // 2, :n] @ q[head, n - 1]).numpy()  # (n,) the row's logits, float64
        p = np.exp(z - z.max())
        want = _shares(p / p.sum(), n, DEFAULT_SINKS, WINDOW)
        np.testing.assert_allclose(budget.share[r], want, rtol=0, atol=SHARE_ATOL, err_msg=f"row {r}, n {n}")
        np.testing.assert_allclose(budget.share[r], _shares(eager[layer][head, n - 1], n, DEFAULT_SINKS, WINDOW),
                                   rtol=0, atol=EAGER_ATOL, err_msg=f"eager, row {r}, n {n}")
    share, n = budget.share.astype(np.float64), stats.n
    np.testing.assert_allclose(share.sum(axis=1), 1.0, rtol=0, atol=1e-6)
    assert np.all(share[n <= DEFAULT_SINKS] == [1, 0, 0])  # a row of at most S keys is all sink
    assert np.all(share[n <= DEFAULT_SINKS + WINDOW, 2] == 0)  # no far keys yet
    # this test can fail: past S + W each set holds a real part of the mass
    assert np.all(share[n > DEFAULT_SINKS + WINDOW].max(axis=0) > 0.1)


def test_right_padding_leaves_the_budget_of_the_real_rows_alone():
    """Calibration's keys are each row's first n: right padding keeps that (left padding would not)."""
    model = _model()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 30:] = 0  # the second sequence has 30 tokens; n = 30 is off the grid, so pad rows are not kept
    padded = _collect(model, ids, attention_mask=mask)
    alone = _collect(model, ids[1:, :30])
    second = padded.select(padded.seq == 1)
    assert second.rows == alone.rows and second.n.max() == 20
    a, b = np.lexsort((second.n, second.head, second.layer)), np.lexsort((alone.n, alone.head, alone.layer))
    np.testing.assert_allclose(second.budget.share[a], alone.budget.share[b], rtol=0, atol=SHARE_ATOL)


@given(seed=st.integers(0, 2**16), keys=st.integers(2, 120), sinks=st.integers(0, 6), window=st.integers(1, 150),
       scale=st.floats(0.1, 3.0))
def test_shares_sum_to_one_and_match_the_reference(seed, keys, sinks, window, scale):
    gen = torch.Generator().manual_seed(seed)
    query, key = torch.randn(2, 2, 5, 16, generator=gen) * scale, torch.randn(2, keys, 16, generator=gen) * scale
    n_visible = torch.randint(2, keys + 1, (5,), generator=gen)
    out = reduce_rows(query, key, n_visible, 0.25, k_max=1, alpha_grid=DEFAULT_ALPHA_GRID,
                      attention_budget=(sinks, window))
    got = out["budget"].reshape(20, 3).numpy().astype(np.float64)
    z = 0.25 * np.einsum("hgrd,hnd->hgrn", query.double().numpy(), key.double().numpy()).reshape(20, keys)
    z = np.where(np.arange(keys)[None] < np.tile(n_visible.numpy(), 4)[:, None], z, -np.inf)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=0, atol=1e-6)
    assert np.all(got >= 0)
    np.testing.assert_allclose(got, budget_from_logits(z, window=window, sinks=sinks), rtol=0, atol=SHARE_ATOL)


def test_reference_follows_the_definition_by_slices():
    rng = np.random.default_rng(3)
    for n in (1, 3, 4, 5, 12, 13, 30):
        z = np.full((1, 30), -np.inf)
        z[0, :n] = rng.normal(0, 2, n)
        p = np.exp(z[0, :n] - z[0, :n].max())
        np.testing.assert_allclose(budget_from_logits(z, window=WINDOW)[0],
                                   _shares(p / p.sum(), n, DEFAULT_SINKS, WINDOW), rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="visible keys first"):
        budget_from_logits([[0.0, -np.inf, 0.0]], window=2)


def _rows(seq, window=WINDOW, seed=0):
    z = np.random.default_rng(seed).normal(0, 2, (4, 40))
    return row_stats_from_logits(z, k_max=2, seq=seq, window=window)


def test_budget_survives_save_load_select_and_concat(tmp_path):
    stats = _rows([0, 0, 1, 1])
    stats.save(tmp_path / "s.npz")
    back, _ = RowStats.load(tmp_path / "s.npz")
    assert (back.budget.sinks, back.budget.window) == (DEFAULT_SINKS, WINDOW)
    np.testing.assert_array_equal(back.budget.share, stats.budget.share)
    np.testing.assert_array_equal(back.select(back.seq == 1).budget.share, stats.budget.share[2:])
    joined = RowStats.concat([stats, _rows([0, 0, 1, 1], seed=1)], separate_runs=True)
    assert joined.budget.rows == joined.rows == 8
    np.testing.assert_array_equal(joined.budget.share[:4], stats.budget.share)
    assert RowStats.concat([stats, replace(_rows([2, 2, 3, 3]), budget=None)]).budget is None  # only some hold one
    with pytest.raises(ValueError, match="different sinks and windows"):
        RowStats.concat([stats, _rows([2, 2, 3, 3], window=16)])
    with pytest.raises(ValueError, match="RowStats.budget must be an AttentionBudget of 4 rows"):
        replace(stats, budget=AttentionBudget(sinks=4, window=8, share=np.zeros((3, 3))))


def test_a_file_without_the_budget_still_loads(tmp_path):
    replace(_rows([0, 0, 1, 1]), budget=None).save(tmp_path / "old.npz")
    with np.load(tmp_path / "old.npz") as data:
        assert not [name for name in data.files if name.startswith("budget")]
    assert RowStats.load(tmp_path / "old.npz")[0].budget is None


def test_curve_is_the_mean_per_n_with_a_band_over_sequences():
    stats = RowStats.concat([_rows([0, 1, 2, 3], seed=s) for s in range(3)], separate_runs=True)
    stats = replace(stats, n=np.repeat([16, 16, 40], 4))  # two sampled lengths
    curve = plots.budget_curve(stats, bootstrap=200)
    assert curve.n.tolist() == [16, 40] and curve.rows.tolist() == [8, 4]
    np.testing.assert_allclose(curve.mean[0], stats.budget.share[:8].mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(curve.mean.sum(axis=1), 1.0, rtol=1e-6)
    assert np.all((curve.low <= curve.mean + 1e-12) & (curve.mean <= curve.high + 1e-12))
    assert np.all(curve.high[0] > curve.low[0])  # this test can fail: 8 sequences differ
    assert np.isnan(plots.budget_curve(stats, bootstrap=0).low).all()
    assert "far share [95%]" in plots.format_budget_table(curve)
    fig = plots.budget_figure(curve, title="synthetic")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_xlabel() and ax.get_ylabel() and ax.get_legend() is not None
    assert any(t.get_text() == f"window W = {WINDOW}" for t in ax.get_legend().get_texts())


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A tiny random Llama calibrated through the command line with --stats: (root folder, statistics file)."""
    root = tmp_path_factory.mktemp("budget")
    tiny_target(0, num_layers=2, vocab_size=VOCAB).save_pretrained(root / "drafter")
    _write_tokenizer(root / "drafter")
    res = runner.invoke(app, ["calibrate", "--drafter", "hf", "--drafter-path", str(root / "drafter"), "--n-ref", "64",
                              "--max-length", "256", "--sequences", "2", "--device", "cpu",
                              "--stats", str(root / "S.npz"), "--out", str(root / "spec.json")])
    assert res.exit_code == 0, res.output
    return root, root / "S.npz"


def test_calibration_records_the_budget_and_plot_draws_it(calibrated, tmp_path):
    _, path = calibrated
    stats, meta = RowStats.load(path)
    assert (stats.budget.sinks, stats.budget.window) == (DEFAULT_SINKS, int(meta["n_ref"])) == (4, 64)
    np.testing.assert_allclose(stats.budget.share.astype(np.float64).sum(axis=1), 1.0, rtol=0, atol=1e-6)
    assert np.all(stats.budget.share[stats.n <= 4 + 64, 2] == 0) and np.all(stats.budget.share[stats.n > 68, 2] > 0)
    res = runner.invoke(app, ["plot", str(path), "--out", str(tmp_path / "plots")])
    assert res.exit_code == 0, res.output
    png = tmp_path / "plots" / plots.BUDGET_FIGURE
    assert f"wrote {png}" in res.output and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = imread(png).shape[:2]
    assert width >= 600 and height >= 350


def test_an_old_statistics_file_plots_without_the_budget(calibrated, tmp_path):
    _, path = calibrated
    stats, meta = RowStats.load(path)
    old = tmp_path / "old.npz"
    replace(stats, budget=None).save(old, **meta)
    res = runner.invoke(app, ["plot", str(old), "--out", str(tmp_path / "plots"), "--bootstrap", "0"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == sorted((*plots.STANDARD_FIGURES,
                                                                             plots.DRIFT_FIGURE))
    assert "old.npz holds no attention budget" in res.output and "budget.png skipped" in res.output


def test_fit_carries_the_budget_and_drops_one_it_cannot_join(calibrated, tmp_path):
    _, path = calibrated
    stats, meta = RowStats.load(path)
    *_, rows, notes = fit_files([path])
    np.testing.assert_array_equal(rows.budget.share, stats.budget.share)
    other = {**meta, "corpus": json.dumps("pydoc:heldout")}  # another corpus, so fit joins the two files
    wider = tmp_path / "wider.npz"
    replace(stats, budget=replace(stats.budget, window=128)).save(wider, **other)
    *_, rows, notes = fit_files([path, wider])
    assert rows.budget is None and any("different sinks and windows (4 sinks and 64 keys, 4 sinks and 128" in note
                                       for note in notes)
    bare = tmp_path / "bare.npz"
    replace(stats, budget=None).save(bare, **other)
    *_, rows, notes = fit_files([path, bare])
    assert rows.budget is None and any(f"{bare} holds no attention budget" in note for note in notes)
