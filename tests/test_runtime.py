"""Tests of sharpdraft_runtime against float64 references that scale the logits explicitly.

The reference path never scales a query: it computes ``softmax(alpha * scaling * q k^T + mask) v``
in float64 with ``alpha`` from ``sharpdraft_theory`` (numpy), and visible keys counted from a
boolean mask built position by position. The runtime path scales float32 queries in place.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from sharpdraft_theory import LAWS, ScaleSpec
from sharpdraft_theory.laws import REGISTRY
from sharpdraft_theory.spec import AlphaTable
from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
from transformers.masking_utils import AttentionMaskInterface, eager_mask

import sharpdraft_runtime as sr
from sharpdraft_runtime.core import QueryScaler

# float32 runtime vs float64 reference. Logits here are O(10) and alpha <= ~3, so each logit
# carries ~30 * 2**-24 ~ 2e-6 of rounding; attention outputs are convex combinations of values
# of size O(1), hence 2e-5 absolute leaves a 10x margin. Whole-model logits pass through two
# layers and an lm_head of width 64: budget 2e-4.
ATOL_ATTENTION = 2e-5
ATOL_MODEL = 2e-4
# torch.log and numpy.log may differ in the last ulp; alpha's are O(1).
RTOL_ALPHA = 1e-14

HYPOTHESIS = settings(derandomize=True, deadline=None, max_examples=25)


def spec_for(law: str, granularity: str = "global", layers: int = 2, heads: int = 4, n_ref: int = 8,
             slope: float = 0.5, alpha_max: float | None = None) -> ScaleSpec:
    """A spec whose slopes differ across layers and heads, so broadcasting mistakes show.

    The tabulated law gets a table of ``(n / n_ref)^slope`` (curved in ln n, > 0 for any slope) at
    knots 1.5, 2, 4 and 16 n_ref, its exponents differing across layers and heads as slopes do.
    """
    if law == "qwen-logn":
        value = None
    elif granularity == "global":
        value = slope
    elif granularity == "layer":
        value = tuple(slope * (1 + i) for i in range(layers))
    else:
        value = tuple(tuple(slope * (1 + i) * (1 + j / heads) for j in range(heads)) for i in range(layers))
    table = None
    if law == "tabulated":
        knots = sorted({max(n_ref + 1, round(n_ref * r)) for r in (1.5, 2, 4, 16)})
        alpha = np.moveaxis(np.power.outer(np.array(knots) / n_ref, value), 0, -1)  # (..., knots)
        table = AlphaTable(n=tuple(knots), alpha=alpha.tolist())
        value = None
    return ScaleSpec(law=law, n_ref=n_ref, slope=value, top_k=2,
                     granularity="global" if value is None and table is None else granularity, alpha_max=alpha_max,
                     table=table)


def reference_attention(query, key, value, visible, scaling, alpha):
    """float64 ``softmax(alpha * scaling * q k^T, masked) v``.

    query (B, H, q, D), key/value (B, KVH, k, D), visible bool (B, 1, q, k), alpha (B, H, q) numpy.
    Returns (B, H, q, D) float64.
    """
    groups = query.shape[1] // key.shape[1]
    q, k, v = (t.double() for t in (query, key, value))
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    logits = torch.tensor(alpha, dtype=torch.float64)[..., None] * scaling * (q @ k.transpose(-1, -2))
    logits = logits.masked_fill(~visible, -math.inf)
    return torch.nan_to_num(torch.softmax(logits, -1)) @ v  # rows that see nothing give 0, as SDPA does


def visible_mask(batch_pad: list[int], past: int, q_len: int, window: int | None = None, causal: bool = True):
    """Boolean (B, 1, q_len, past + q_len) mask built key by key: left padding, causality, window."""
    k_len = past + q_len
    mask = torch.zeros(len(batch_pad), 1, q_len, k_len, dtype=torch.bool)
    for b, pad in enumerate(batch_pad):
        for i in range(q_len):
            p = past + i
            for j in range(pad, k_len):
                mask[b, 0, i, j] = (not causal or j <= p) and (window is None or j > p - window)
    return mask


# -- alpha: the torch laws agree with sharpdraft_theory ---------------------------------------------------------------

@pytest.mark.parametrize("law", LAWS)
@pytest.mark.parametrize("granularity", ["global", "layer", "head"])
@pytest.mark.parametrize("alpha_max", [None, 1.7])
def test_alpha_matches_theory(law, granularity, alpha_max):
    spec = spec_for(law, granularity, n_ref=64, slope=0.3, alpha_max=alpha_max)
    n = np.unique(np.geomspace(1, 1e6, 400).astype(np.int64))
    for layer in range(2):
        got = sr.alpha_for(spec, torch.from_numpy(n), layer=layer, dtype=torch.float64)  # (1, 1|H, len(n))
        want = spec.alpha(n, layer=layer if granularity != "global" else None)  # (len(n),) or (len(n), H)
        want = want.T if want.ndim == 2 else want[None]
        np.testing.assert_allclose(got[0].numpy(), np.broadcast_to(want, got[0].shape), rtol=RTOL_ALPHA)


@pytest.mark.parametrize("law", LAWS)
@pytest.mark.parametrize("granularity", ["global", "layer"])
@pytest.mark.parametrize("alpha_max", [None, 1.7])
def test_host_alpha_matches_theory(law, granularity, alpha_max):
    """One count on the host (a decoding step's factor, plain Python floats) against the float64 reference."""
    spec = spec_for(law, granularity, n_ref=64, slope=0.3, alpha_max=alpha_max)
    scaler = QueryScaler(spec)
    n = np.unique(np.geomspace(1, 1e6, 200).astype(np.int64))
    for layer in range(2):
        layer = layer if spec.granularity != "global" else None
        got = np.array([scaler.host_alpha(int(m), layer) for m in n])
        assert all(isinstance(scaler.host_alpha(int(m), layer), float) for m in n[:3])
        np.testing.assert_allclose(got, spec.alpha(n, layer=layer), rtol=RTOL_ALPHA)


def test_host_alpha_refuses_per_head_specs_and_missing_layers():
    with pytest.raises(ValueError, match="per-head parameters"):
        QueryScaler(spec_for("log-linear", "head")).host_alpha(500, 0)
    with pytest.raises(ValueError, match="pass layer="):
        QueryScaler(spec_for("log-linear", "layer")).host_alpha(500)
    with pytest.raises(ValueError, match="layer 7 is out of range"):
        QueryScaler(spec_for("log-linear", "layer")).host_alpha(500, 7)


@pytest.mark.parametrize("law", LAWS)
@pytest.mark.parametrize("granularity", ["global", "layer", "head"])
def test_one_row_scales_as_the_tensor_path(law, granularity):
    """A decoding step's count, given as an int or a one-element tensor (read on the host), scales the query as the
    tensor path does, to float32 rounding of alpha; a count within the identity limit leaves it untouched (laws
    that have one)."""
    spec = spec_for(law, granularity, n_ref=16, slope=0.4)
    scaler = QueryScaler(spec)
    query = torch.randn(1, 4, 1, 8, generator=torch.Generator().manual_seed(3))
    layer = None if spec.granularity == "global" else 1
    for n in (5, 16, 17, 300, 10**6):
        want = query * scaler.alpha(torch.tensor([[n]]), layer)[..., None]
        for given in (n, torch.tensor([[n]])):
            got = scaler.scale_query_(query.clone(), given, layer)
            torch.testing.assert_close(got, want, rtol=2e-7, atol=0)  # alpha rounded to float32 once either way
    if scaler.identity_limit >= 5:  # ssmax and constant scale every count
        unscaled = query.clone()
        assert scaler.scale_query_(unscaled, torch.tensor([[5]]), layer) is unscaled and torch.equal(unscaled, query)


def alphas_in_every_precision(spec: ScaleSpec, n: np.ndarray) -> dict:
    """alpha(n) of a global spec from numpy (float64) and the runtime in float64 and float32."""
    out = {"numpy": spec.alpha(n)}
    for dtype in (torch.float64, torch.float32):
        out[str(dtype)] = QueryScaler(spec, dtype=dtype).alpha(torch.from_numpy(n))[0, 0].double().numpy()
    return out


def assert_identity_limit_exact(spec: ScaleSpec, moves: bool) -> None:
    """alpha == 1 exactly for n <= the limit (sound: skipping the multiply changes nothing), in every
    precision; and, when alpha leaves 1 by more than rounding, alpha != 1 at limit + 1 (tight)."""
    limit = QueryScaler(spec).identity_limit
    assert limit == spec.identity_limit()
    n = np.arange(0, 4 * (spec.n_ref or 8))
    for where, alpha in alphas_in_every_precision(spec, n).items():
        assert np.all(alpha[n <= limit] == 1.0), (where, limit, alpha[n <= limit].max())
        if moves and math.isfinite(limit):
            assert alpha[n == limit + 1][0] != 1.0, (where, limit)


@given(law=st.sampled_from(LAWS), n_ref=st.integers(3, 5000), slope=st.floats(-0.5, 2.0),
       alpha_max=st.one_of(st.none(), st.floats(0.5, 4.0)))
@HYPOTHESIS
def test_identity_limit_is_exact(law, n_ref, slope, alpha_max):
    if alpha_max is not None and alpha_max < REGISTRY[law].min_alpha_max:
        alpha_max = 1.0 / alpha_max  # below the law's smallest cap (log-linear: 1)
    if REGISTRY[law].has_slope:  # the spec refuses slopes that take alpha to 0 or below (test_spec)
        assume(REGISTRY[law].bounds(n_ref=n_ref, values=np.array(slope))[0] > 0)
    spec = spec_for(law, n_ref=n_ref, slope=slope, alpha_max=alpha_max)
    # alpha leaves 1 by more than rounding (qwen-logn has no slope: 1 / ln n_ref is at least 1 / ln 5000).
    moves = (alpha_max is None or abs(alpha_max - 1) > 1e-3) and (law == "qwen-logn" or abs(slope) > 1e-3)
    assert_identity_limit_exact(spec, moves)


@pytest.mark.parametrize("law", LAWS)
def test_identity_limit_is_exact_for_every_reference_length(law):
    # Written as ln n / ln n_ref with the two logarithms rounded apart, qwen-logn's alpha(n_ref) is 1 + 1 ulp
    # in float32 for about one n_ref in 200; its registry form is exactly 1 up to n_ref.
    for n_ref in range(3, 1025):
        spec = spec_for(law, n_ref=n_ref, slope=0.3)
        assert_identity_limit_exact(spec, moves=True)


def test_identity_limit_of_flat_and_capped_specs():
    assert spec_for("log-linear", "head", slope=0.0).identity_limit() == math.inf
    assert spec_for("constant", slope=0.0).identity_limit() == math.inf
    assert spec_for("ssmax", slope=0.5).identity_limit() == -1  # alpha(1) = 0.5 * ln 1 = 0
    assert spec_for("llama4", slope=0.5, alpha_max=0.9).identity_limit() == -1


def test_a_spec_that_never_scales_leaves_the_query_alone_without_computing_alpha(monkeypatch):
    """A spec whose alpha is 1 at every n (a window, sinks or a distance fix alone: law constant) returns the
    query itself, untouched, and computes no alpha for it (a decoding step pays nothing for the scale)."""
    scaler = sr.QueryScaler(spec_for("constant", slope=0.0))
    monkeypatch.setattr(scaler, "alpha", lambda *a, **k: pytest.fail("alpha computed for a spec that never scales"))
    query = torch.randn(1, 2, 3, 4)
    before = query.clone()
    assert scaler.scale_query_(query, torch.tensor([[5000, 6000, 7000]])) is query and torch.equal(query, before)
    moving = sr.QueryScaler(spec_for("log-linear", n_ref=8, slope=0.5))  # this test can fail: a real scale computes
    monkeypatch.setattr(moving, "alpha", lambda *a, **k: pytest.fail("computed"))
    with pytest.raises(pytest.fail.Exception, match="computed"):
        moving.scale_query_(query, torch.tensor([[5000, 6000, 7000]]))


def test_log_linear_is_exactly_one_up_to_n_ref():
    spec = spec_for("log-linear", n_ref=512, slope=0.25)
    alpha = sr.alpha_for(spec, torch.arange(0, 513))
    assert torch.equal(alpha, torch.ones_like(alpha))
    assert sr.alpha_for(spec, torch.tensor([513])).item() > 1


# Tabulated alpha in float32 against float64: n / n_ref, its logarithm, each segment's intercept and
# gradient and the sum each round once to 2**-24 ~ 6e-8 relative, on terms a few times alpha at most
# (intercept and gradient x ln(n / n_ref) may be larger than alpha, of opposite signs): a few 1e-7
# relative (5e-7 seen); 2e-6 leaves a margin.
RTOL_TABLE_FLOAT32 = 2e-6
# float64: the same roundings at 2**-53, and torch.log vs numpy's interpolation arithmetic.
RTOL_TABLE_FLOAT64 = 1e-13


def test_tabulated_alpha_is_exact_against_interpolation_in_ln_n():
    """The runtime's table, on the device, against numpy's own linear interpolation in ln n (float64):
    1 up to n_ref, each knot's value at the knot, linear in ln n between, held past the last knot."""
    spec = spec_for("tabulated", "head", n_ref=256, slope=0.4)  # (n / n_ref)^slope: curved in ln n
    knots = np.array(spec.table.n)
    n = np.unique(np.concatenate([np.geomspace(1, 1e7, 3000).astype(np.int64), knots - 1, knots, knots + 1]))
    x, xp = np.log(n), np.log(np.concatenate([[spec.n_ref], knots]))
    for layer in range(2):
        values = spec.values()[layer]  # (heads, knots)
        want = np.stack([np.interp(x, xp, np.concatenate([[1.0], v])) for v in values])  # (heads, len(n))
        for dtype, rtol in ((torch.float64, RTOL_TABLE_FLOAT64), (torch.float32, RTOL_TABLE_FLOAT32)):
            got = QueryScaler(spec, dtype=dtype).alpha(torch.from_numpy(n), layer)[0].double().numpy()
            np.testing.assert_allclose(got, want, rtol=rtol, atol=0, err_msg=str(dtype))
        assert np.all(want[:, n <= spec.n_ref] == 1.0) and np.all(want[:, n >= knots[-1]] == values[:, -1:])
        # this test can fail: interpolating in n instead of ln n misses by far more than the tolerance
        in_n = np.interp(n, np.exp(xp), np.concatenate([[1.0], values[0]]))
        assert np.max(np.abs(in_n - want[0]) / want[0]) > 1e3 * RTOL_TABLE_FLOAT32


def test_tabulated_scale_query_matches_float64_attention():
    """A tabulated per-head spec through scale_query_ (float32, in place) against float64 attention."""
    spec = spec_for("tabulated", "head", n_ref=8, slope=0.6)
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 4, 40, 16, generator=gen) for _ in range(3))
    visible = visible_mask([0, 3], past=0, q_len=40)
    n = visible.sum(-1)[:, 0]  # (B, q)
    want = reference_attention(query, key[:, :4], value[:, :4], visible, 0.25,
                               np.stack([spec.alpha(n[b].numpy(), layer=1).T for b in range(2)]))
    with torch.no_grad():
        scaled = sr.scale_query_(query.clone(), n, spec, layer=1)
        got = torch.nn.functional.scaled_dot_product_attention(scaled, key, value, attn_mask=visible, scale=0.25)
    got = torch.nan_to_num(got)
    torch.testing.assert_close(got.double(), want, atol=ATOL_ATTENTION, rtol=0)
    plain = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=0.25)
    assert (torch.nan_to_num(plain) - got).abs().max() > 100 * ATOL_ATTENTION  # this test can fail: alpha matters


def test_per_layer_spec_needs_a_layer():
    with pytest.raises(ValueError, match="pass layer="):
        sr.alpha_for(spec_for("log-linear", "layer"), torch.tensor([5]))
    with pytest.raises(ValueError, match="layer 7 is out of range"):
        sr.alpha_for(spec_for("log-linear", "layer"), torch.tensor([5]), layer=7)


# -- visible keys -----------------------------------------------------------------------------------------------------

@given(pads=st.lists(st.integers(0, 12), min_size=1, max_size=3), past=st.integers(0, 20), q_len=st.integers(1, 9),
       window=st.one_of(st.none(), st.integers(1, 15)))
@HYPOTHESIS
def test_causal_n_visible_counts_the_mask(pads, past, q_len, window):
    k_len = past + q_len
    pads = [min(p, k_len) for p in pads]
    mask = visible_mask(pads, past, q_len, window)
    key_mask = torch.arange(k_len)[None, :] >= torch.tensor(pads)[:, None]  # (B, k_len): False on left padding
    got = sr.causal_n_visible(q_len, past, key_mask=key_mask, sliding_window=window)  # (B, q_len)
    want = mask.sum(-1)[:, 0]  # (B, q_len)
    assert torch.equal(got, want)
    assert torch.equal(sr.mask_n_visible(mask)[:, 0].long(), want)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)  # eager's float mask
    assert torch.equal(sr.mask_n_visible(additive)[:, 0].long(), want)
    if not any(pads):
        assert torch.equal(sr.causal_n_visible(q_len, past, sliding_window=window).expand_as(want), want)


@pytest.mark.parametrize("k_len", [1, 127, 128, 129, 300, 4099])
def test_mask_count_over_groups(k_len):
    mask = torch.rand(2, 3, 5, k_len + 7, generator=torch.Generator().manual_seed(k_len)) < 0.9
    assert torch.equal(sr.mask_n_visible(mask, k_len).long(), mask[..., :k_len].sum(-1))


# -- scale_query_ against the float64 reference -----------------------------------------------------------------------

@given(pads=st.lists(st.integers(0, 6), min_size=1, max_size=2), past=st.integers(0, 60), q_len=st.integers(1, 16),
       kv_heads=st.integers(1, 2), groups=st.integers(1, 3), head_dim=st.sampled_from([8, 16]),
       window=st.one_of(st.none(), st.integers(4, 40)), law=st.sampled_from(LAWS),
       granularity=st.sampled_from(["global", "layer", "head"]), causal=st.booleans())
@HYPOTHESIS
def test_scale_query_matches_reference(pads, past, q_len, kv_heads, groups, head_dim, window, law, granularity,
                                       causal):
    heads, k_len, layer = kv_heads * groups, past + q_len, 1
    spec = spec_for(law, granularity, heads=heads)
    gen = torch.Generator().manual_seed(past * 97 + q_len)
    query = 3 * torch.randn(len(pads), heads, q_len, head_dim, generator=gen)
    key = 3 * torch.randn(len(pads), kv_heads, k_len, head_dim, generator=gen)
    value = torch.randn(len(pads), kv_heads, k_len, head_dim, generator=gen)
    visible = visible_mask(pads, past, q_len, window, causal)  # causal=False: a non-causal (DFlash) block
    n = visible.sum(-1)  # (B, 1, q_len)
    granularity = spec.granularity  # qwen-logn has no slope, hence always global
    alpha = spec.alpha(n.numpy(), layer=None if granularity == "global" else layer)  # (B, 1, q[, H])
    alpha = np.moveaxis(alpha[:, 0], -1, 1) if granularity == "head" else alpha[:, 0][:, None]  # (B, H|1, q)
    scaling = head_dim**-0.5
    want = reference_attention(query, key, value, visible, scaling, alpha)

    scaled = sr.scale_query_(query.clone(), sr.mask_n_visible(visible), spec, layer)
    got = torch.nn.functional.scaled_dot_product_attention(scaled, key, value, attn_mask=visible, scale=scaling,
                                                           enable_gqa=True)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=ATOL_ATTENTION)


def test_scale_query_is_in_place_without_grad_and_out_of_place_with_it():
    spec = spec_for("log-linear", n_ref=4)
    query = torch.ones(1, 2, 3, 4)
    with torch.no_grad():
        assert sr.scale_query_(query, torch.tensor([8, 9, 10]), spec) is query
    assert query[0, 0, 0, 0] == pytest.approx(1 + 0.5 * math.log(2))

    leaf = torch.ones(1, 2, 3, 4, requires_grad=True)
    out = sr.scale_query_(leaf, torch.tensor([8, 9, 10]), spec)
    assert out is not leaf and torch.equal(leaf.detach(), torch.ones(1, 2, 3, 4))
    out.sum().backward()
    assert leaf.grad[0, 0, 0, 0] == pytest.approx(1 + 0.5 * math.log(2))


def test_scale_query_skips_when_alpha_is_one():
    spec = spec_for("log-linear", n_ref=64)
    query = torch.randn(1, 2, 3, 4)
    before = query.clone()
    assert sr.scale_query_(query, 64, spec) is query and torch.equal(query, before)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # unfused on CPU, same math
def test_flex_score_mod_matches_scale_query():
    from torch.nn.attention.flex_attention import flex_attention

    spec = spec_for("log-linear", "head", heads=4)
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, h, 6, 8, generator=gen) for h in (4, 2, 2))
    n = torch.tensor([[9, 10, 11, 12, 13, 14], [20, 21, 22, 23, 24, 25]])
    got = flex_attention(query, key, value, score_mod=sr.flex_score_mod(spec, n, layer=1), enable_gqa=True)
    want = torch.nn.functional.scaled_dot_product_attention(sr.scale_query_(query.clone(), n, spec, 1), key, value,
                                                            enable_gqa=True)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL_ATTENTION)


# -- transformers integration -----------------------------------------------------------------------------------------

def tiny_llama(attn_implementation: str = "sdpa", cls=LlamaForCausalLM, config_cls=LlamaConfig, **extra):
    """A 2-layer GQA decoder (4 query heads, 2 key/value heads) with random weights."""
    torch.manual_seed(0)
    config = config_cls(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.25,
                        attn_implementation=attn_implementation, **extra)
    return cls(config).eval()


def reference_attention_fn(spec: ScaleSpec):
    """A float64 attention function for the interface: counts visible keys from eager's float mask."""

    def attend(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if attention_mask is None:  # a non-causal block (DFlash): every key
            visible = torch.ones(query.shape[0], 1, query.shape[2], key.shape[2], dtype=torch.bool)
        else:
            visible = attention_mask > torch.finfo(attention_mask.dtype).min  # (B, 1, q, k)
        n = visible.sum(-1).numpy()  # (B, 1, q)
        layer = None if spec.granularity == "global" else module.layer_idx
        alpha = spec.alpha(n, layer=layer)
        alpha = np.moveaxis(alpha[:, 0], -1, 1) if spec.granularity == "head" else alpha[:, 0][:, None]
        out = reference_attention(query, key, value, visible, scaling, alpha)
        return out.transpose(1, 2).contiguous(), None

    return attend


def reference_model(model, spec):
    """A float64 copy of ``model`` whose attention is :func:`reference_attention_fn` on eager masks."""
    name = "sharpdraft-test-reference"
    AttentionInterface.register(name, reference_attention_fn(spec))
    AttentionMaskInterface.register(name, eager_mask)
    ref = copy.deepcopy(model).double()
    ref.set_attn_implementation(name)
    return ref


def run_scenario(model, scenario: str, ids: torch.Tensor):
    """Final logits (float64) of one scenario: prefill, padded prefill, cached decoding or a draft block."""
    batch, length = ids.shape
    mask = torch.ones(batch, length, dtype=torch.long)
    if scenario == "padded":
        mask[1:, :5] = 0  # left padding: row 1 starts 5 tokens later
        # Padding queries see no key: their outputs are arbitrary (eager averages, SDPA zeroes), so drop them.
        return model(ids, attention_mask=mask).logits.double() * mask[..., None]
    if scenario == "prefill":
        return model(ids).logits.double()
    split = length - (1 if scenario == "decode" else 6)  # decode: 1 token at a time; block: 6 at once
    cache = DynamicCache(config=model.config)
    model(ids[:, :split], cache=cache)
    outs = []
    for start in range(split, length, 1 if scenario == "decode" else 6):
        stop = start + (1 if scenario == "decode" else 6)
        outs.append(model(ids[:, start:stop], attention_mask=mask[:, :stop], cache=cache).logits)
    return torch.cat(outs, 1).double()


@pytest.mark.parametrize("scenario", ["prefill", "padded", "decode", "block"])
@pytest.mark.parametrize(("wrapped", "granularity"), [("sdpa", "global"), ("sdpa", "head"), ("eager", "layer")])
def test_enable_matches_float64_reference(wrapped, scenario, granularity):
    """Global and layer specs fold alpha into ``scaling`` when all rows share n (decoding); head specs scale q."""
    model = tiny_llama(wrapped)
    spec = spec_for("log-linear", granularity, n_ref=8, slope=0.6)
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    ref = reference_model(model, spec)
    with torch.inference_mode():
        want = run_scenario(ref, scenario, ids)
        plain = run_scenario(model, scenario, ids)
        sr.enable(model, spec)
        got = run_scenario(model, scenario, ids)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL_MODEL)
    assert (plain - want).abs().max() > 100 * ATOL_MODEL  # the scaling is visible: this test can fail


def test_enable_sliding_window_matches_reference():
    model = tiny_llama("sdpa", MistralForCausalLM, MistralConfig, sliding_window=12)
    spec = spec_for("log-linear", "layer", n_ref=6, slope=0.6)
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(2))
    ref = reference_model(model, spec)
    with torch.inference_mode():
        want = run_scenario(ref, "padded", ids)
        got = run_scenario(sr.enable(model, spec), "padded", ids)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL_MODEL)


def test_non_causal_block_sees_every_key():
    """DFlash calls the interface with is_causal=False and no mask: every query sees all k_len keys."""
    model = tiny_llama("sdpa")
    spec = spec_for("log-linear", "head", n_ref=8, slope=0.6)
    sr.enable(model, spec)
    module = model.model.layers[1].self_attn
    gen = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(2, h, 16 if h == 4 else 50, 16, generator=gen) for h in (4, 2, 2))
    alpha = np.broadcast_to(spec.alpha(50, layer=1)[None, :, None], (2, 4, 16))
    want = reference_attention(query, key, value, torch.ones(2, 1, 16, 50, dtype=torch.bool), 0.25, alpha)
    with torch.inference_mode():
        got, _ = sr.sharpdraft_attention(module, query.clone(), key, value, None, scaling=0.25, is_causal=False)
    torch.testing.assert_close(got.transpose(1, 2).double(), want, rtol=0, atol=ATOL_ATTENTION)


@pytest.mark.parametrize("wrapped", ["sdpa", "eager"])
def test_alpha_one_is_bit_identical(wrapped):
    model = tiny_llama(wrapped)
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        before = {s: run_scenario(model, s, ids) for s in ("prefill", "padded", "decode", "block")}
        sr.enable(model, spec_for("log-linear", "head", n_ref=1000))  # n_ref above every n
        after = {s: run_scenario(model, s, ids) for s in before}
    for scenario in before:
        assert torch.equal(before[scenario], after[scenario]), scenario


def test_enable_then_disable_restores_the_model():
    model = tiny_llama("sdpa")
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(5))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    with torch.inference_mode():
        before = run_scenario(model, "padded", ids)
        sr.enable(model, spec_for("log-linear", n_ref=8))
        assert model.config._attn_implementation == sr.NAME and sr.is_enabled(model)
        scaled = run_scenario(model, "padded", ids)
        sr.disable(model)
        after = run_scenario(model, "padded", ids)
    assert not torch.equal(before, scaled)
    assert torch.equal(before, after)
    assert model.config.to_dict() == config and not sr.is_enabled(model)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_enable_rejects_bad_inputs():
    model = tiny_llama("sdpa")
    with pytest.raises(ValueError, match="for 3 layers, the model has 2 layers x 4 heads"):
        sr.enable(model, spec_for("log-linear", "layer", layers=3))
    with pytest.raises(ValueError, match="for 5 heads, the model has 2 layers x 4 heads"):
        sr.enable(model, spec_for("log-linear", "head", heads=5))
    with pytest.raises(ValueError, match="not enabled"):
        sr.disable(model)
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("wrapped", ["sdpa", "eager"])
def test_enable_on_dflash_matches_reference(tmp_path, wrapped):
    """calibrate's DFlash drafter: own dataclass config, non-causal blocks over context + block keys."""
    from calibrate.drafters.dflash import load_dflash
    from tiny_checkpoints import tiny_target, write_tiny_dflash

    target = tiny_target(num_layers=6)
    model = load_dflash(write_tiny_dflash(tmp_path, target, block_size=4), target).eval()
    model.set_attn_implementation(wrapped)
    spec = spec_for("log-linear", "head", n_ref=8, slope=0.6)
    gen = torch.Generator().manual_seed(6)
    context, block = torch.randn(2, 30, 192, generator=gen), torch.randn(2, 4, 64, generator=gen)  # 3 target layers
    positions = torch.arange(34).expand(2, 34)
    ref = copy.deepcopy(model).double()
    AttentionInterface.register("sharpdraft-test-dflash", reference_attention_fn(spec))
    ref.set_attn_implementation("sharpdraft-test-dflash")
    with torch.inference_mode():
        want = ref(block.double(), context.double(), positions)
        plain = model(block, context, positions).double()
        got = sr.enable(model, spec)(block, context, positions).double()
        sr.disable(model)
        assert torch.equal(model(block, context, positions).double(), plain)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL_MODEL)
    assert (plain - want).abs().max() > 10 * ATOL_MODEL


def test_query_hook_on_eagle3_head(tmp_path):
    """calibrate's EAGLE-3 head exposes a query hook; query_hook applies the same core through it."""
    from calibrate.drafters.eagle3 import load_eagle3_head
    from tiny_checkpoints import tiny_target, write_tiny_eagle3

    target = tiny_target(num_layers=6)
    head = load_eagle3_head(write_tiny_eagle3(tmp_path, target), target).eval()
    spec = spec_for("log-linear", "head", layers=1, n_ref=8, slope=0.6)
    gen = torch.Generator().manual_seed(7)
    ids, features = torch.randint(0, 256, (2, 30), generator=gen), torch.randn(2, 30, 192, generator=gen)

    def numpy_alpha(layer_idx, query, key, scaling, n_visible):  # (B, q) -> alpha (B, H, q) from the theory
        alpha = np.moveaxis(spec.alpha(n_visible.numpy(), layer=layer_idx), -1, 1)
        return query * torch.tensor(alpha, dtype=query.dtype)[..., None]

    with torch.inference_mode():
        want = head(ids, features, attention_hook=numpy_alpha).logits
        got = head(ids, features, attention_hook=sr.query_hook(spec)).logits
        plain = head(ids, features).logits
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL_MODEL)
    assert (plain - want).abs().max() > 10 * ATOL_MODEL


def test_docstring_examples():
    """The runtime's doctests (pyproject's testpaths collect doctests from sharpdraft_theory only)."""
    import doctest

    from sharpdraft_runtime import core, visible

    for module, examples in ((core, 4), (visible, 5)):
        result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.attempted >= examples and result.failed == 0, module.__name__
