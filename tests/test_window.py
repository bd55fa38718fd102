"""A spec's window and sinks (the drafter attention restrictions serving engines use) against float64 references.

The reference never uses the runtime's window rule: it takes the keys the unrestricted mask allows
and keeps, per query row, the last W of them and the first S (ranks counted over the visible keys,
SGLang's draft window, "the last W visible keys", and StreamingLLM's "first S keys of the sequence"), then computes
``softmax(alpha(n) * scaling * q k^T) v`` in float64 with ``n`` the keys kept. The runtime builds the
restricted mask through transformers' mask function (or the EAGLE-3 head's own mask) and counts it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask

import sharpdraft_runtime as sr
from sharpdraft_runtime import hf as runtime_hf
from sharpdraft_theory import ScaleSpec

from test_runtime import ATOL_ATTENTION, ATOL_MODEL, HYPOTHESIS, reference_attention, run_scenario, tiny_llama

WINDOW, SINKS = 12, 3


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)


def keep_last_and_first(visible: torch.Tensor, window: int, sinks: int | None) -> torch.Tensor:
    """Of the keys ``visible`` (bool, (..., k)) allows, keep the last ``window`` and the first ``sinks`` per row."""
    from_right = visible.flip(-1).long().cumsum(-1).flip(-1)  # visible keys at or right of j
    from_left = visible.long().cumsum(-1)  # visible keys at or left of j
    keep = from_right <= window
    if sinks is not None:
        keep = keep | (from_left <= sinks)  # a causal row sees its sequence from the first key on
    return visible & keep


def spec_with(law: str, window: int = WINDOW, sinks: int | None = None) -> ScaleSpec:
    if law == "constant":  # a pure baseline: alpha = 1, only the window
        return ScaleSpec(law="constant", n_ref=None, slope=0.0, top_k=2, window=window, sinks=sinks)
    return ScaleSpec(law="log-linear", n_ref=6, slope=(0.6, 1.2), top_k=2, granularity="layer", window=window,
                     sinks=sinks)


# -- the count from positions equals the count of the mask ------------------------------------------------------------

def reference_mask(pads: list[int], past: int, q_len: int, window: int, sinks: int | None) -> torch.Tensor:
    """(B, q_len, k_len) bool: causal, left padding, then the last W / first S visible keys."""
    visible = torch.zeros(len(pads), q_len, past + q_len, dtype=torch.bool)
    for b, pad in enumerate(pads):
        for i in range(q_len):
            visible[b, i, pad:past + i + 1] = True
    return keep_last_and_first(visible, window, sinks)


@given(pads=st.lists(st.integers(0, 12), min_size=1, max_size=3), past=st.integers(0, 20), q_len=st.integers(1, 9),
       window=st.integers(1, 15), sinks=st.one_of(st.none(), st.integers(1, 6)))
@HYPOTHESIS
def test_causal_n_visible_counts_window_and_sinks(pads, past, q_len, window, sinks):
    k_len = past + q_len
    pads = [min(p, k_len) for p in pads]
    want = reference_mask(pads, past, q_len, window, sinks)  # (B, q_len, k_len)
    key_mask = torch.arange(k_len)[None, :] >= torch.tensor(pads)[:, None]
    got = sr.causal_n_visible(q_len, past, key_mask=key_mask, sliding_window=window, sinks=sinks)
    assert torch.equal(got, want.sum(-1))
    if not any(pads):
        mask = sr.causal_mask(q_len, past, sliding_window=window, sinks=sinks)
        assert torch.equal(mask, want[0])
        assert torch.equal(sr.causal_n_visible(q_len, past, sliding_window=window, sinks=sinks)[0], mask.sum(-1))


def test_sinks_need_a_window():
    with pytest.raises(ValueError, match="give sliding_window too"):
        sr.causal_n_visible(3, sinks=2)


# -- transformers models: enable(model, spec) -------------------------------------------------------------------------

def restricted_reference_fn(spec: ScaleSpec, counts: list):
    """float64 attention on eager's unrestricted mask, restricted here by ranks; records the counts."""

    def attend(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        visible = attention_mask > torch.finfo(attention_mask.dtype).min  # (B, 1, q, k) causal + padding
        kept = keep_last_and_first(visible, spec.window, spec.sinks)
        n = kept.sum(-1).numpy()  # (B, 1, q)
        counts.append(kept.sum(-1))
        layer = None if spec.granularity == "global" else module.layer_idx
        alpha = spec.alpha(n, layer=layer)[:, 0][:, None]  # (B, 1, q)
        out = reference_attention(query, key, value, kept, scaling, alpha)
        return out.transpose(1, 2).contiguous(), None

    return attend


@pytest.mark.parametrize("scenario", ["prefill", "padded", "decode", "block"])
@pytest.mark.parametrize("law, sinks", [("constant", None), ("constant", SINKS), ("log-linear", None),
                                        ("log-linear", SINKS)])
@pytest.mark.parametrize("wrapped", ["sdpa", "eager"])
def test_enable_window_and_sinks_match_float64_reference(wrapped, law, sinks, scenario, monkeypatch):
    model = tiny_llama(wrapped)
    spec = spec_with(law, sinks=sinks)
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(11))
    name = "sharpdraft-test-window-reference"
    ref_counts, runtime_counts = [], []
    AttentionInterface.register(name, restricted_reference_fn(spec, ref_counts))
    AttentionMaskInterface.register(name, eager_mask)
    ref = copy.deepcopy(model).double()
    ref.set_attn_implementation(name)

    def spy(query, key, attention_mask=None, **kw):
        n = sr.visible_keys(query, key, attention_mask, **kw)
        runtime_counts.append(torch.as_tensor(n).long().expand(query.shape[0], 1, query.shape[2]))
        return n

    with torch.inference_mode():
        want = run_scenario(ref, scenario, ids)
        plain = run_scenario(model, scenario, ids)
        monkeypatch.setattr(runtime_hf, "visible_keys", spy)
        sr.enable(model, spec)
        try:
            got = run_scenario(model, scenario, ids)
        finally:
            sr.disable(model)
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL_MODEL)
    assert (plain - want).abs().max() > 100 * ATOL_MODEL  # the window binds: this test can fail
    if law == "log-linear":  # the constant law never scales, so never counts
        assert len(runtime_counts) == len(ref_counts)
        for mine, theirs in zip(runtime_counts, ref_counts):
            rows = theirs > 0  # padding queries see nothing either way
            assert torch.equal(mine[rows], theirs[rows])
        assert max(int(n.max()) for n in runtime_counts) == WINDOW + (sinks or 0)


def test_enable_window_on_a_non_causal_block_is_refused():
    model = tiny_llama("sdpa")
    sr.enable(model, spec_with("constant"))
    module = model.model.layers[0].self_attn
    query, key = torch.randn(1, 4, 4, 16), torch.randn(1, 2, 30, 16)
    with pytest.raises(ValueError, match="window \\(12\\) restricts causal attention"):
        sr.sharpdraft_attention(module, query, key, key, None, is_causal=False)
    sr.disable(model)


# -- the EAGLE-3 head's own mask ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("sinks", [None, SINKS])
def test_eagle3_head_window_matches_float64_reference(tmp_path, sinks, monkeypatch):
    from calibrate.drafters import eagle3
    from tiny_checkpoints import tiny_target, write_tiny_eagle3

    target = tiny_target(num_layers=6)
    head = eagle3.load_eagle3_head(write_tiny_eagle3(tmp_path, target), target).eval()
    spec = ScaleSpec(law="log-linear", n_ref=6, slope=0.6, top_k=2, window=WINDOW, sinks=sinks)
    gen = torch.Generator().manual_seed(12)
    ids, features = torch.randint(0, 256, (1, 36), generator=gen), torch.randn(1, 36, 192, generator=gen)
    restrict = {"window": spec.window, "sinks": spec.sinks}
    seen = []

    def record(layer_idx, query, key, scaling, n_visible):
        seen.append(n_visible.clone())

    with torch.inference_mode():
        got = head(ids, features, attention_hook=sr.query_hook(spec), **restrict).logits.double()
        plain = head(ids, features).logits.double()
        # a cached draft block of 6 rows after 30 gives the same rows as the full pass
        prefix = head(ids[:, :30], features[:, :30], attention_hook=sr.query_hook(spec), **restrict)
        block = head(ids[:, 30:], features[:, 30:], past_key_values=prefix.past_key_values,
                     attention_hook=sr.query_hook(spec), **restrict).logits.double()
        head(ids, features, attention_hook=record, **restrict)

        def reference_mask_fn(q_len, past, *, sliding_window, sinks, device):
            causal = torch.ones(past + q_len, past + q_len, dtype=torch.bool).tril()
            return keep_last_and_first(causal, sliding_window, sinks)[past:]

        def numpy_alpha(layer_idx, query, key, scaling, n_visible):
            alpha = spec.alpha(n_visible.numpy())  # (B, q)
            return query * torch.tensor(alpha, dtype=query.dtype)[:, None, :, None]

        monkeypatch.setattr(eagle3, "causal_mask", reference_mask_fn)
        ref = copy.deepcopy(head).double()
        want = ref(ids, features.double(), attention_hook=numpy_alpha, **restrict).logits
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL_MODEL)
    torch.testing.assert_close(block, got[:, 30:], rtol=0, atol=ATOL_MODEL)
    assert (plain - want).abs().max() > 100 * ATOL_MODEL  # this test can fail
    causal = torch.ones(36, 36, dtype=torch.bool).tril()
    assert torch.equal(seen[0][0], keep_last_and_first(causal, WINDOW, sinks).sum(-1))


# -- FlexAttention --------------------------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # unfused on CPU, same math
@pytest.mark.parametrize("sinks", [None, SINKS])
def test_flex_mask_mod_matches_the_runtime(sinks):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    spec = ScaleSpec(law="log-linear", n_ref=6, slope=0.6, top_k=2, window=WINDOW, sinks=sinks)
    gen = torch.Generator().manual_seed(13)
    past, q_len = 20, 8
    query = torch.randn(1, 4, q_len, 16, generator=gen)
    key, value = (torch.randn(1, 2, past + q_len, 16, generator=gen) for _ in range(2))
    n = sr.causal_n_visible(q_len, past, sliding_window=WINDOW, sinks=sinks)  # (1, q_len)
    block_mask = create_block_mask(sr.flex_mask_mod(spec, past), 1, 1, q_len, past + q_len, device="cpu")
    got = flex_attention(query, key, value, score_mod=sr.flex_score_mod(spec, n), block_mask=block_mask,
                         enable_gqa=True)
    causal = torch.ones(past + q_len, past + q_len, dtype=torch.bool).tril()
    visible = keep_last_and_first(causal, WINDOW, sinks)[past:]  # (q_len, k_len)
    alpha = spec.alpha(visible.sum(-1).numpy())[None, None]  # (1, 1, q_len)
    want = reference_attention(query, key, value, visible[None, None], 16 ** -0.5, alpha)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=ATOL_ATTENTION)
    assert torch.equal(n[0], visible.sum(-1))
