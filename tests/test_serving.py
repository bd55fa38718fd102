"""The serving engine's side of a spec, without the engine: visible-key counts from a batched call's metadata,
the per-row factor against sharpdraft_theory's float64 alpha(n), layer selection, and the refusals.

Tolerance: the runtime computes alpha in float32, so the factor matches float64 to a few float32 ulps
(rtol 1e-6); a scaled query row is the float32 product of its original by that factor, exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from sharpdraft_theory import AlphaTable, ScaleSpec, SpecError
from sharpdraft_runtime.serving import (SPEC_ENV, TokenScaler, check_engine, drafter_layer, load_spec, spec_path,
                                        visible_counts)

HYPOTHESIS = settings(derandomize=True, deadline=None, max_examples=25)
ALPHA_RTOL = 1e-6  # float32 alpha against the float64 reference
HEADS = 9

SPECS = {
    "global": ScaleSpec(law="log-linear", n_ref=16, slope=0.3, top_k=4),
    "layer": ScaleSpec(law="log-linear", n_ref=16, slope=[0.3, 0.1], top_k=4, granularity="layer"),
    "head": ScaleSpec(law="log-linear", n_ref=16, slope=[[0.05 * h for h in range(HEADS)]] * 2, top_k=4,
                      granularity="head"),
    "tabulated": ScaleSpec(law="tabulated", n_ref=16, slope=None, top_k=4,
                           table=AlphaTable(n=(32, 64, 128), alpha=(1.2, 1.5, 1.6))),
    "qwen-logn": ScaleSpec(law="qwen-logn", n_ref=16, slope=None, top_k=4, alpha_max=2.0),
    "window": ScaleSpec(law="log-linear", n_ref=16, slope=0.3, top_k=4, window=24),
}


def _loop_counts(query_start_loc, seq_lens, num_tokens, window=None):
    """The counts the module docstring states, request by request, row by row."""
    out = []
    for r, seq_len in enumerate(seq_lens):
        q_len = query_start_loc[r + 1] - query_start_loc[r]
        out += [seq_len - q_len + j + 1 for j in range(q_len)]
    out = out[:num_tokens]
    return out if window is None else [min(n, window) for n in out]


@st.composite
def _batches(draw):
    """A batched call: per request q_len >= 0 and cached keys, then padding rows."""
    q_lens = draw(st.lists(st.integers(0, 6), min_size=1, max_size=5))
    past = draw(st.lists(st.integers(0, 300), min_size=len(q_lens), max_size=len(q_lens)))
    starts = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
    seq_lens = [p + q for p, q in zip(past, q_lens)]
    pad = draw(st.integers(0, 3))
    return starts, seq_lens, starts[-1] - draw(st.integers(0, min(pad, starts[-1])))


@HYPOTHESIS
@given(batch=_batches(), window=st.one_of(st.none(), st.integers(1, 64)))
def test_counts_are_seq_len_minus_q_len_plus_j_plus_1(batch, window):
    starts, seq_lens, num_tokens = batch
    got = visible_counts(torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                         num_tokens, window)
    assert got.tolist() == _loop_counts(starts, seq_lens, num_tokens, window)


@pytest.mark.parametrize("name", SPECS)
@HYPOTHESIS
@given(batch=_batches(), layer=st.integers(0, 1))
def test_each_row_is_scaled_by_alpha_of_its_count(name, batch, layer):
    spec = SPECS[name]
    starts, seq_lens, num_tokens = batch
    total = starts[-1]
    query = torch.randn(total + 2, HEADS, 8, generator=torch.Generator().manual_seed(0))  # 2 padding rows past all
    before = query.clone()
    scaled = TokenScaler(spec).scale_(query, torch.tensor(starts), torch.tensor(seq_lens), num_tokens, layer)
    n = np.array(_loop_counts(starts, seq_lens, num_tokens, spec.window), dtype=np.float64)
    expected = spec.alpha(n, layer=None if spec.granularity == "global" else layer)  # (T,) or (T, heads)
    expected = np.broadcast_to(expected if expected.ndim == 2 else expected[:, None], (num_tokens, HEADS))
    if scaled is None:  # skipped only when every factor is 1
        assert np.all(expected == 1.0) and torch.equal(query, before)
        return
    counts, alpha = scaled
    assert counts.tolist() == n.astype(int).tolist()
    np.testing.assert_allclose(np.broadcast_to(alpha[:, :, 0].numpy(), expected.shape), expected, rtol=ALPHA_RTOL)
    assert torch.equal(query[:num_tokens], before[:num_tokens] * alpha)
    assert torch.equal(query[num_tokens:], before[num_tokens:])  # padding rows are left alone


def test_a_call_within_n_ref_is_left_alone():
    scaler = TokenScaler(SPECS["global"])
    assert not scaler.active(torch.tensor([16, 3])) and scaler.active(torch.tensor([17]))
    windowed = TokenScaler(ScaleSpec(law="log-linear", n_ref=16, slope=0.3, top_k=4, window=16))
    assert not windowed.active(torch.tensor([5000]))  # the window keeps every n within n_ref
    assert not TokenScaler(ScaleSpec(law="constant", n_ref=None, slope=0.0, top_k=4, window=8)).active(
        torch.tensor([5000]))


def test_drafter_layers_are_picked_by_name():
    names = [f"model.layers.{i}.self_attn.attn" for i in range(33)]
    assert [drafter_layer(n, 30, 2) for n in names] == [None] * 30 + [0, 1, None]
    assert drafter_layer("lm_head", 30, 1) is None
    assert drafter_layer("model.layers.300.self_attn.attn", 30, 1) is None


def test_spec_path_is_none_when_unset_or_empty():
    assert spec_path({}) is None and spec_path({SPEC_ENV: ""}) is None
    assert spec_path({SPEC_ENV: "a.json"}) == "a.json"


def _write(tmp_path, **fields) -> str:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"law": "log-linear", "n_ref": 256, "slope": 0.3, "top_k": 4, **fields}))
    return str(path)


DRAFTER = {"kind": "eagle3", "path": None, "num_layers": 1, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64}


@pytest.mark.parametrize("fields,fragment", [
    ({"positions": {"fix": "clamp", "window": 128}}, "field 'positions' (clamp)"),
    ({"window": 200, "sinks": 4}, "field 'sinks' (4)"),
    ({"drafter": {**DRAFTER, "kind": "pard"}}, "field 'drafter.kind' (pard)"),
    ({"slope": -1}, "slope"),
    ({"n_ref": "long"}, "n_ref"),
])
def test_unservable_specs_are_refused_in_one_line(tmp_path, fields, fragment):
    path = _write(tmp_path, **fields)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    assert fragment in str(err.value) and "\n" not in str(err.value) and path in str(err.value)


def test_a_window_is_servable(tmp_path):
    assert load_spec(_write(tmp_path, window=200)).window == 200


ENGINE = dict(cpu=True, method="eagle3", draft_layers=1, draft_heads=9, draft_length=4096, serving_length=4096,
              draft_path=None)


@pytest.mark.parametrize("over,fragment", [
    ({"cpu": False}, "CPU attention only"),
    ({"method": None}, "speculative method is none"),
    ({"method": "ngram"}, "speculative method is ngram"),
    ({"draft_heads": 32}, "32 heads"),
    ({"draft_layers": 2}, "2 layers"),
    ({"draft_length": 256}, "max_position_embeddings 256"),
    ({"draft_path": "@pointer"}, "copy pointer"),
])
def test_engines_that_cannot_apply_the_spec_are_refused(tmp_path, over, fragment):
    (tmp_path / "copy_pointer.json").write_text("{}")
    over = {k: (str(tmp_path) if v == "@pointer" else v) for k, v in over.items()}
    spec = ScaleSpec(law="log-linear", n_ref=256, slope=0.3, top_k=4, drafter=None if "draft_layers" in over else
                     ScaleSpec.from_dict({"law": "log-linear", "n_ref": 256, "slope": 0.3, "top_k": 4,
                                          "drafter": DRAFTER}).drafter)
    check_engine(spec, **ENGINE)
    with pytest.raises(SpecError) as err:
        check_engine(spec if "draft_layers" not in over else
                     ScaleSpec(law="log-linear", n_ref=256, slope=[0.3], top_k=4, granularity="layer"),
                     **{**ENGINE, **over})
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_the_serving_side_needs_neither_calibrate_nor_vllm():
    code = ("import sys, sharpdraft_runtime.serving; "
            "bad = sorted({m.split('.')[0] for m in sys.modules} & {'calibrate', 'vllm'}); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
