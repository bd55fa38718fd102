"""The torch row reduction against the float64 numpy reference, and the attention tap."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import LlamaConfig, LlamaForCausalLM

from calibrate.collect import RowCollector, alpha_lattice, log_grid, reduce_rows
from calibrate.errors import UserError
from calibrate.taps import TAP_IMPLEMENTATION, attention_tap
from sharpdraft_theory.stats import DEFAULT_ALPHA_GRID, DISTANCE_ALPHAS, distance_edges, row_stats_from_logits

# Tolerances of the fp32 reduction against float64 on the same query/key values (logits up to
# about 40 in magnitude). Reasons:
#  top, mean, tilted_mean: one fp32 dot product of head_dim terms, ~1e-6 relative to |q||k|.
#  lse: each term is a product of two exp2 factors (a few ulp), summed by an fp32 matrix
#       product (~sqrt(keys) ulp), plus a*z at a <= 4.
#  var: sums of squares accumulated in float64 from fp32 values; absolute error ~1e-5 * z^2.
ATOL = {"top": 2e-4, "lse": 5e-4, "tilted_mean": 2e-4, "mean": 2e-4, "var": 5e-3}
RTOL = 1e-5


def _reference(query, key, n_visible, scaling, k_max):
    """Float64 statistics of every (kv head, group, row), in (KVH, G, R) order."""
    q = query.double().numpy()
    k = key.double().numpy()
    kvh, group, rows, _ = q.shape
    z = scaling * np.einsum("hgrd,hnd->hgrn", q, k).reshape(kvh * group * rows, -1)
    n = np.tile(n_visible.numpy(), kvh * group)
    z = np.where(np.arange(z.shape[1])[None, :] < n[:, None], z, -np.inf)
    return row_stats_from_logits(z, k_max=k_max)


def _random_rows(seed, kv_heads, group, rows, keys, head_dim, scale):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(kv_heads, group, rows, head_dim, generator=gen) * scale
    key = torch.randn(kv_heads, keys, head_dim, generator=gen) * scale
    key[:, 0] *= 3  # an attention-sink-like key far above the rest
    n_visible = torch.randint(17, keys + 1, (rows,), generator=gen)
    return query, key, n_visible


@pytest.mark.parametrize("kv_heads,group", [(1, 1), (2, 3), (3, 1)])
@pytest.mark.parametrize("scale", [0.5, 1.5, 2.5])
def test_reduce_rows_matches_float64_reference(kv_heads, group, scale):
    query, key, n_visible = _random_rows(kv_heads * 10 + group, kv_heads, group, 7, 300, 32, scale)
    scaling = 32 ** -0.5
    out = reduce_rows(query, key, n_visible, scaling, k_max=16, alpha_grid=DEFAULT_ALPHA_GRID)
    ref = _reference(query, key, n_visible, scaling, 16)
    if scale > 1:
        assert np.abs(ref.top).max() > 5  # logits well away from 0
    for name, atol in ATOL.items():
        got = out[name].reshape(kv_heads * group * 7, *out[name].shape[3:]).numpy()
        np.testing.assert_allclose(got, getattr(ref, name), rtol=RTOL, atol=atol * max(1.0, scale**2), err_msg=name)


def test_default_grid_is_one_small_matrix_product():
    lattice = alpha_lattice(DEFAULT_ALPHA_GRID)
    assert (lattice.base.numel(), lattice.step.numel()) == (9, 16)  # 25 exponentials per logit for 101 sums
    assert lattice.index.max() < 9 * 16 and DEFAULT_ALPHA_GRID[lattice.one] == 1.0


@pytest.mark.parametrize("grid", [[0.5, 1.0, 1.7, 3.1], [1.0], [0.5, 0.6, 0.7, 1.0, 2.5]])
def test_reduce_rows_on_grids_off_a_lattice(grid):
    query, key, n_visible = _random_rows(5, 2, 2, 5, 120, 16, 1.5)
    out = reduce_rows(query, key, n_visible, 0.25, k_max=8, alpha_grid=grid)
    ref = _reference(query, key, n_visible, 0.25, 8)
    z = 0.25 * np.einsum("hgrd,hnd->hgrn", query.double().numpy(), key.double().numpy()).reshape(20, -1)
    z = np.where(np.arange(120)[None] < np.tile(n_visible.numpy(), 4)[:, None], z, -np.inf)
    lse = np.stack([np.logaddexp.reduce(a * z, axis=1) for a in grid], axis=1)
    np.testing.assert_allclose(out["lse"].reshape(20, -1).numpy(), lse, rtol=RTOL, atol=ATOL["lse"])
    np.testing.assert_allclose(out["tilted_mean"].reshape(20).numpy(), ref.tilted_mean, rtol=RTOL,
                               atol=ATOL["tilted_mean"])


def test_reduce_rows_on_long_rows_and_wide_logits():
    """Rows longer than a CPU tile (keys summed tile by tile) and logits spread far past exp's range."""
    query, key, n_visible = _random_rows(11, 1, 2, 2, 40_000, 16, 3.0)
    n_visible = torch.tensor([25_000, 40_000])
    out = reduce_rows(query, key, n_visible, 0.5, k_max=16, alpha_grid=DEFAULT_ALPHA_GRID)
    ref = _reference(query, key, n_visible, 0.5, 16)
    spread = ref.top[:, 0] - ref.mean
    assert spread.min() > 50  # e^{-4 * 50}: far below fp32's smallest normal number (e^-87), so terms are floored
    for name, atol in ATOL.items():
        got = out[name].reshape(4, *out[name].shape[3:]).numpy()
        np.testing.assert_allclose(got, getattr(ref, name), rtol=RTOL, atol=atol, err_msg=name)


@given(seed=st.integers(0, 2**16), rows=st.integers(1, 6), keys=st.integers(20, 200),
       scale=st.floats(0.1, 2.0))
def test_reduce_rows_property(seed, rows, keys, scale):
    query, key, n_visible = _random_rows(seed, 2, 2, rows, keys, 16, scale)
    out = reduce_rows(query, key, n_visible, 0.25, k_max=8, alpha_grid=DEFAULT_ALPHA_GRID)
    ref = _reference(query, key, n_visible, 0.25, 8)
    got = out["lse"].reshape(4 * rows, -1).numpy()
    np.testing.assert_allclose(got, ref.lse, rtol=RTOL, atol=ATOL["lse"])
    # top-k mass never exceeds 1 (top logits are part of the lse sum)
    i1 = int(np.argmin(np.abs(DEFAULT_ALPHA_GRID - 1)))
    top = out["top"].reshape(4 * rows, -1).numpy().astype(np.float64)
    assert np.all(np.log(np.exp(top - top[:, :1]).sum(1)) + top[:, 0] <= got[:, i1] + 1e-4)


@pytest.mark.parametrize("kv_heads,group", [(1, 1), (2, 3)])
@pytest.mark.parametrize("scale", [0.5, 2.5])
def test_distance_sums_match_float64_reference(kv_heads, group, scale):
    query, key, n_visible = _random_rows(kv_heads * 10 + group, kv_heads, group, 7, 300, 32, scale)
    scaling, edges = 32 ** -0.5, distance_edges(300)
    out = reduce_rows(query, key, n_visible, scaling, k_max=16, alpha_grid=DEFAULT_ALPHA_GRID,
                      distance=(torch.as_tensor(edges), tuple(DISTANCE_ALPHAS)))
    q, k = query.double().numpy(), key.double().numpy()
    z = scaling * np.einsum("hgrd,hnd->hgrn", q, k).reshape(kv_heads * group * 7, -1)
    n = np.tile(n_visible.numpy(), kv_heads * group)
    z = np.where(np.arange(z.shape[1])[None, :] < n[:, None], z, -np.inf)
    ref = row_stats_from_logits(z, k_max=16, head=np.repeat(np.arange(kv_heads * group), 7), edges=edges).distance
    got = out["distance"]
    assert ref.keys.sum() > 0 and ref.weight[..., -1].max() < ref.weight[..., 0].max()  # this test can fail
    for name in ("weight", "keys", "sink", "rows"):
        # Weights exp(a (z - t0)) <= 1 from fp32 logits (error ~1e-6 |z| per unit of a, a <= 4), summed in
        # fp32 over at most 7 x 300 keys per bin: 1e-4 relative, 1e-6 absolute on sums of numbers <= 1.
        np.testing.assert_allclose(got[name].reshape(kv_heads * group, *got[name].shape[2:]).numpy(),
                                   getattr(ref, name)[0, 0], rtol=1e-4, atol=1e-6, err_msg=name)


def test_log_grid_is_log_spaced_and_ends_at_max_length():
    grid = log_grid(2048)
    assert grid[0] == 32 and grid[-1] == 2048
    assert np.all(np.diff(grid) > 0)
    ratios = grid[1:] / grid[:-1]
    assert np.all(ratios <= 2 ** (1 / 8) + 0.05)
    assert len(grid) == 49
    assert log_grid(20).tolist() == [20]


def _tiny_llama(layers=2, heads=4, kv_heads=2, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=16 * heads, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
                      max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


def test_tap_leaves_outputs_unchanged_and_restores_implementation():
    model = _tiny_llama()
    ids = torch.randint(0, 97, (2, 80))
    with torch.no_grad():
        plain = model(ids).logits
        calls = []
        with attention_tap(model, lambda layer, q, k, s, n: calls.append((layer, q.shape, k.shape, s, n.clone()))):
            assert model.config._attn_implementation == TAP_IMPLEMENTATION
            tapped = model(ids).logits
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(plain, tapped)  # bit for bit: the tap delegates to transformers' sdpa
    assert [c[0] for c in calls] == [0, 1]
    assert calls[0][1] == (2, 4, 80, 16) and calls[0][2] == (2, 2, 80, 16)
    assert calls[0][3] == pytest.approx(16 ** -0.5)
    assert torch.equal(calls[0][4], torch.arange(1, 81).expand(2, 80))


def test_tap_restores_implementation_after_an_error():
    model = _tiny_llama()

    def boom(*args):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"), attention_tap(model, boom):
        model(torch.randint(0, 97, (1, 10)))
    assert model.config._attn_implementation == "sdpa"


def test_collector_keeps_grid_rows_of_every_layer_and_head():
    model = _tiny_llama(layers=3, heads=6, kv_heads=2)
    grid = log_grid(200)
    collector = RowCollector(grid)
    collector.start(7)
    with torch.no_grad(), attention_tap(model, collector):
        model(torch.randint(0, 97, (1, 200)))
    stats = collector.take()
    assert stats.rows == len(grid) * 3 * 6
    assert set(stats.seq.tolist()) == {7}
    assert sorted(set(stats.layer.tolist())) == [0, 1, 2] and sorted(set(stats.head.tolist())) == list(range(6))
    for layer in range(3):
        for head in range(6):
            sel = (stats.layer == layer) & (stats.head == head)
            assert sorted(stats.n[sel].tolist()) == grid.tolist()
    assert stats.top.dtype == np.float32 and stats.lse.dtype == np.float32


def test_collector_matches_reference_on_model_rows_and_chunking_does_not_matter():
    model = _tiny_llama(heads=4, kv_heads=2)
    for p in model.parameters():  # larger weights: logits of several units, as in trained models
        p.data.mul_(4)
    ids = torch.randint(0, 97, (1, 300))
    captured = {}

    def keep(layer, q, k, s, n):
        captured[layer] = (q.clone(), k.clone(), s)

    with torch.no_grad(), attention_tap(model, keep):
        model(ids)
    grid = log_grid(300)
    results = []
    for chunk, budget in [(None, 1 << 19), (1, 1 << 19), (None, 4000)]:
        collector = RowCollector(grid, chunk=chunk, budget=budget)
        collector.start(0)
        with torch.no_grad(), attention_tap(model, collector):
            model(ids)
        results.append(collector.take())
    q, k, scaling = captured[1]
    qh = q[0].reshape(2, 2, 300, 16)
    for head in range(4):
        sel = (results[0].layer == 1) & (results[0].head == head)
        n = torch.as_tensor(results[0].n[sel])
        ref = _reference(qh[head // 2, head % 2][None, None, n - 1], k[0, head // 2][None], n, scaling, 16)
        for name, atol in ATOL.items():
            np.testing.assert_allclose(getattr(results[0], name)[sel], getattr(ref, name), rtol=RTOL, atol=atol,
                                       err_msg=name)
    for other in results[1:]:
        order_a = np.lexsort((results[0].n, results[0].head, results[0].layer))
        order_b = np.lexsort((other.n, other.head, other.layer))
        for name in ("top", "lse", "tilted_mean", "mean", "var"):
            np.testing.assert_allclose(getattr(other, name)[order_b], getattr(results[0], name)[order_a],
                                       rtol=2e-5, atol=1e-5, err_msg=name)  # matmul blocking differs
        for name in ("weight", "keys", "sink", "rows"):  # the profile does not depend on the chunking either
            np.testing.assert_allclose(getattr(other.distance, name), getattr(results[0].distance, name),
                                       rtol=1e-4, atol=1e-6, err_msg=name)
    assert results[0].distance.rows.shape == (1, 2, 4) and np.all(results[0].distance.rows == grid.size)


def test_collector_rejects_non_finite_logits():
    collector = RowCollector(log_grid(64))
    collector.start(3)
    query = torch.randn(1, 2, 64, 8)
    query[0, 1, 40] = float("nan")
    key = torch.randn(1, 2, 64, 8)
    collector(5, query, key, 0.3, torch.arange(1, 65)[None])
    with pytest.raises(UserError, match="non-finite attention logits in layer 5 of sequence 3"):
        collector.take()  # checked when the sequence's statistics come to the host


def test_collector_without_rows_says_so():
    collector = RowCollector(log_grid(64))
    collector.start(0)
    with pytest.raises(UserError, match="no attention rows"):
        collector.take()
