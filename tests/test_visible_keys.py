"""The visible-key count n: the calibration tap, the runtime binding and the kernel agree, call by call.

Every scenario runs one tiny model three times over the same inputs, hence through the same
attention calls (same shapes, same masks, same ``is_causal``):

* under the calibration tap (``calibrate.taps.attention_tap``), recording the ``n_visible`` it hands over;
* under the runtime binding (``sharpdraft_runtime.enable``), recording the count it scales by;
* under a probe that computes each call's attention weights in float64 and counts the keys whose
  weight is not zero. For sdpa the probe runs transformers' own ``sdpa_attention_forward`` on
  one-hot values (``value`` = identity, so each output row *is* the row's softmax), so the count
  is what the kernel computes, alignment of ``is_causal`` and key cropping included. For eager
  attention it is eager's formula, ``softmax(scaling * q k^T + mask)``, in float64.

The scenarios: prefill, left padding, cached decoding (with and without padding), a draft block
after a cache, a static-cache prefill (keys longer than queries, no mask), sliding windows, and
non-causal DFlash blocks.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, StaticCache)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import sharpdraft_runtime as sr
from calibrate.drafters.dflash import load_dflash
from calibrate.taps import attention_tap
from sharpdraft_runtime import hf as runtime_hf
from sharpdraft_theory import ScaleSpec

from tiny_checkpoints import tiny_target, write_tiny_dflash

SPEC = ScaleSpec(law="log-linear", n_ref=2, slope=0.5, top_k=1)  # identity limit 2: every call here counts
PROBE = "sharpdraft-test-probe"
MASKS = {"sdpa": sdpa_mask, "eager": eager_mask}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)


def tiny_decoder(implementation: str = "sdpa", sliding_window: int | None = None):
    """2 layers, 4 query heads over 2 key/value heads (GQA); Mistral when a sliding window is asked for."""
    torch.manual_seed(0)
    cls, config_cls, extra = LlamaForCausalLM, LlamaConfig, {}
    if sliding_window is not None:
        cls, config_cls, extra = MistralForCausalLM, MistralConfig, {"sliding_window": sliding_window}
    config = config_cls(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        initializer_range=0.25, attn_implementation=implementation, **extra)
    return cls(config).eval()


def reference_weights(implementation, module, query, key, attention_mask, scaling, kwargs) -> torch.Tensor:
    """Attention weights (B, heads, q_len, k_len) of one call, in float64 (module docstring)."""
    batch, heads, q_len, _ = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    mask = attention_mask if attention_mask is None or attention_mask.dtype == torch.bool else attention_mask.double()
    if implementation == "sdpa":
        one_hot = torch.eye(k_len, dtype=torch.float64).expand(batch, kv_heads, k_len, k_len)
        out, _ = sdpa_attention_forward(module, query.double(), key.double(), one_hot, mask, scaling=scaling,
                                        **kwargs)  # (B, q_len, heads, k_len): row i is the weights of query i
        return out.transpose(1, 2)
    keys = key.double().repeat_interleave(heads // kv_heads, dim=1)
    logits = scaling * query.double() @ keys.transpose(-1, -2)  # (B, heads, q_len, k_len)
    return torch.softmax(logits if mask is None else logits + mask, dim=-1)


def per_head(n, query) -> torch.Tensor:
    """A count (int, (B|1, H|1, q_len) or the tap's (B, q_len)) spread to (B, heads, q_len)."""
    batch, heads, q_len, _ = query.shape
    n = torch.as_tensor(n).long()
    n = n[:, None] if n.ndim == 2 else n
    return n.expand(batch, heads, q_len)


class Probe:
    """Attention function that records the float64 reference of each call, then runs the real kernel."""

    def __init__(self, implementation: str):
        self.implementation = implementation
        self.weights = []  # per call: (B, heads, q_len, k_len) float64

    def __call__(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        self.weights.append(reference_weights(self.implementation, module, query, key, attention_mask, scaling,
                                              kwargs))
        kernel = ALL_ATTENTION_FUNCTIONS[self.implementation] if self.implementation == "sdpa" else None
        if kernel is None:
            from transformers.models.llama.modeling_llama import eager_attention_forward as kernel
        return kernel(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def run(model, scenario: str, ids: torch.Tensor) -> None:
    """One scenario's forwards (the attention calls under test)."""
    batch, length = ids.shape
    mask = torch.ones(batch, length, dtype=torch.long)
    if scenario.startswith("padded"):
        mask[1, :5] = 0  # left padding: row 1 starts 5 tokens later
    if scenario in ("prefill", "padded"):
        model(ids, attention_mask=mask)
        return
    if scenario == "static":  # a static cache longer than the prompt: keys past the prompt are empty slots
        model(ids, cache=StaticCache(config=model.config, max_cache_len=length + 16))
        return
    step = 6 if scenario == "block" else 1  # a draft block after a cache, or decoding one token at a time
    split = length - 2 * step
    cache = DynamicCache(config=model.config)
    model(ids[:, :split], attention_mask=mask[:, :split], cache=cache)
    for start in range(split, length, step):
        model(ids[:, start:start + step], attention_mask=mask[:, :start + step], cache=cache)


def counts_three_ways(model, forward, implementation: str, monkeypatch):
    """(tap counts, runtime counts, probe weights) per attention call of ``forward(model)``."""
    taps, runtime = [], []
    probe = Probe(implementation)
    with torch.inference_mode():
        if implementation == "sdpa":  # the tap always wraps sdpa
            with attention_tap(model, lambda layer, query, key, scaling, n: taps.append(per_head(n, query))):
                forward(model)

        def spy(query, key, attention_mask=None, **kw):
            n = sr.visible_keys(query, key, attention_mask, **kw)
            runtime.append(per_head(n, query))
            return n

        monkeypatch.setattr(runtime_hf, "visible_keys", spy)
        sr.enable(model, SPEC)
        try:
            forward(model)
        finally:
            sr.disable(model)
        AttentionInterface.register(PROBE, probe)
        AttentionMaskInterface.register(PROBE, MASKS[implementation])
        model.set_attn_implementation(PROBE)
        try:
            forward(model)
        finally:
            model.set_attn_implementation(implementation)
    return taps, runtime, probe.weights


def assert_counts_match(taps, runtime, weights, *, seen_rows_only: bool = False):
    assert len(runtime) == len(weights) > 0 and len(taps) in (0, len(weights))
    for call, w in enumerate(weights):
        nonzero = (w != 0).sum(-1)  # (B, heads, q_len): keys the kernel gives weight
        rows = torch.ones_like(nonzero, dtype=torch.bool)
        if seen_rows_only:
            # eager gives a query that sees no key (a padding query) the average of every key, sdpa
            # zeros; the row's output is thrown away, and the count for it is 0.
            rows = runtime[call] > 0
        assert torch.equal(runtime[call][rows], nonzero[rows]), f"runtime, call {call}"
        if taps:
            assert torch.equal(taps[call], runtime[call]), f"tap, call {call}"


SCENARIOS = ["prefill", "padded", "decode", "padded-decode", "block", "static"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_tap_and_runtime_count_what_sdpa_attends(scenario, monkeypatch):
    model = tiny_decoder("sdpa")
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    taps, runtime, weights = counts_three_ways(model, lambda m: run(m, scenario, ids), "sdpa", monkeypatch)
    assert_counts_match(taps, runtime, weights)
    if scenario == "static":  # the case sdpa's upper-left alignment decides: keys outnumber queries
        assert weights[0].shape[-1] > weights[0].shape[-2]
        assert torch.equal(runtime[0][0, 0], torch.arange(1, 25))  # this test can fail: bottom-right gives 17..40
    if scenario == "block":
        assert torch.equal(runtime[-1][0, 0], torch.arange(19, 25))  # 18 cached keys, then 1..6 of the block


@pytest.mark.parametrize("scenario", ["prefill", "padded", "decode", "padded-decode", "block"])
def test_runtime_counts_what_eager_attends(scenario, monkeypatch):
    model = tiny_decoder("eager")
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(2))
    taps, runtime, weights = counts_three_ways(model, lambda m: run(m, scenario, ids), "eager", monkeypatch)
    assert_counts_match(taps, runtime, weights, seen_rows_only=True)


@pytest.mark.parametrize("scenario", ["padded", "padded-decode", "block"])
def test_sliding_window_caps_the_count(scenario, monkeypatch):
    window = 8
    model = tiny_decoder("sdpa", sliding_window=window)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    taps, runtime, weights = counts_three_ways(model, lambda m: run(m, scenario, ids), "sdpa", monkeypatch)
    assert_counts_match(taps, runtime, weights)
    assert max(int(n.max()) for n in runtime) == window  # the window binds: this test can fail


def test_non_causal_dflash_blocks_see_every_key(tmp_path, monkeypatch):
    target = tiny_target(num_layers=6)
    model = load_dflash(write_tiny_dflash(tmp_path, target, block_size=4), target)
    gen = torch.Generator().manual_seed(4)
    context, block = torch.randn(2, 30, 192, generator=gen), torch.randn(2, 4, 64, generator=gen)
    positions = torch.arange(34).expand(2, 34)
    taps, runtime, weights = counts_three_ways(model, lambda m: m(block, context, positions), "sdpa", monkeypatch)
    assert_counts_match(taps, runtime, weights)
    assert all(torch.equal(n, torch.full((2, 4, 4), 34)) for n in runtime)  # context + the whole block


# -- the count of one call ---------------------------------------------------------------------------------------------

class _Module(torch.nn.Module):
    """What transformers' attention functions read from the layer."""

    def __init__(self, is_causal: bool = True, groups: int = 1):
        super().__init__()
        self.is_causal, self.num_key_value_groups = is_causal, groups


def test_sdpa_without_a_mask_is_upper_left_aligned():
    """Causal sdpa without a mask and with more keys than queries: query i sees keys 0 .. i."""
    gen = torch.Generator().manual_seed(5)
    query, key = torch.randn(1, 2, 3, 8, generator=gen), torch.randn(1, 2, 5, 8, generator=gen)
    weights = reference_weights("sdpa", _Module(), query, key, None, 8 ** -0.5, {})
    n = sr.visible_keys(query, key)
    assert torch.equal(per_head(n, query), (weights != 0).sum(-1))
    assert n.flatten().tolist() == [1, 2, 3]  # not the bottom-right 3, 4, 5
    assert sr.visible_keys(query, key, is_causal=False) == 5
    assert sr.visible_keys(query, key, module=_Module(is_causal=False)) == 5
    assert sr.visible_keys(query[:, :, :1], key) == 5  # one query: sdpa turns is_causal off
    assert sr.visible_keys(query, key, implementation="eager") == 5  # eager masks nothing without a mask


@pytest.mark.parametrize("kind", ["bool", "finfo-min", "-inf", "biased"])
def test_per_head_masks(kind):
    """Per-head masks of every kind: counts per head equal the kernel's non-zero weights."""
    gen = torch.Generator().manual_seed(6)
    query, key = torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 9, 8, generator=gen)
    visible = torch.rand(2, 4, 5, 9, generator=gen) < 0.6
    visible[..., 0] = True  # every row sees a key
    if kind == "bool":
        mask = visible
    else:
        masked = {"finfo-min": torch.finfo(torch.float32).min, "-inf": float("-inf"), "biased": float("-inf")}[kind]
        bias = torch.randn(visible.shape, generator=gen) if kind == "biased" else torch.zeros(visible.shape)
        mask = bias.masked_fill(~visible, masked)  # visible keys may carry a bias: they still count
    n = sr.visible_keys(query, key, mask)
    weights = reference_weights("sdpa", _Module(groups=2), query, key, mask, 8 ** -0.5, {})
    assert n.shape == (2, 4, 5)
    assert torch.equal(n.long(), (weights != 0).sum(-1))
    assert torch.equal(n.long(), visible.sum(-1))


def test_the_tap_refuses_a_per_head_mask():
    """Taps take one count per query row; a mask that differs across heads is refused, not averaged."""
    model = tiny_decoder("sdpa")
    module = model.model.layers[0].self_attn
    query, key, value = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    mask = torch.ones(1, 4, 3, 3, dtype=torch.bool)
    mask[0, 1, :, 0] = False
    with attention_tap(model, lambda *args: None), pytest.raises(ValueError, match="per-head mask"):
        ALL_ATTENTION_FUNCTIONS[model.config._attn_implementation](module, query, key, value, mask)


def test_bad_calls():
    query, key = torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4)
    with pytest.raises(ValueError, match="4D attention mask"):
        sr.visible_keys(query, key, torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="implementation must be one of sdpa, eager"):
        sr.visible_keys(query, key, implementation="flash_attention_2")
