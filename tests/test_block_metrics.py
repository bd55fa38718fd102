"""Per-position metrics of drafters that draft K tokens in one forward (calibrate.measure.blocks).

Each quantity is recomputed directly: a DFlash block run alone over the context before its anchor,
a PARD drafter's uncached forward over the text and its mask tokens, the target's laws from its full
logits, and the expected accepted length ``sum_j prod_{i <= j} a_i`` in float64 from those laws.
Tolerances: 1e-5 on acceptance sums of float32 softmaxes over 256 tokens (rounding is ~1e-7 per
term); agreement and greedy accepted lengths exactly.
"""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch

from calibrate.drafters import blocks as block_module
from calibrate.drafters.dflash import DFlashAdapter, load_dflash
from calibrate.drafters.hf import CausalLMAdapter
from calibrate.measure import blocks
from calibrate.measure.blocks import block_anchors, block_rows, block_sums, check_block_unit, summarize_blocks
from sharpdraft_theory import ScaleSpec

from tiny_checkpoints import tiny_target, write_tiny_dflash

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

T, BS, K, TEMP = 48, 5, 4, 0.8
SPECS = {"none": None, "spec": ScaleSpec(law="log-linear", n_ref=8, slope=0.6, top_k=4)}


def test_doctests():
    for module in (blocks, block_module):
        assert doctest.testmod(module).failed == 0


@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


@pytest.fixture(scope="module")
def text():
    return torch.randint(0, 250, (1, T), generator=torch.Generator().manual_seed(5))


def _target_law(target, text, positions):
    """float64 softmax at TEMP of the target's logits after each of ``positions``, and its argmax."""
    with torch.no_grad():
        logits = target(text).logits[0].double()
    return torch.softmax(logits[positions] / TEMP, -1), logits[positions].argmax(-1)


def _direct(rows_logits, p_law, greedy):
    """hits (K,), acceptance (K,), greedy accepted length, expected accepted length, in float64."""
    q = torch.softmax(rows_logits.double() / TEMP, -1)
    accept = torch.minimum(p_law, q).sum(-1).numpy()
    hits = (rows_logits.argmax(-1) == greedy).numpy()
    return hits, accept, int(np.cumprod(hits).sum()), float(sum(np.prod(accept[:j + 1]) for j in range(len(accept))))


def _check(rows, anchors, direct_rows):
    for name, (hits, accept) in rows.items():
        sums = block_sums({name: (hits, accept)}, np.zeros(len(anchors), dtype=int), 1)[name]
        lengths, expected = 0, 0.0
        for a, p in enumerate(anchors):
            d_hits, d_accept, d_len, d_exp = direct_rows(name, int(p))
            assert hits[a].tolist() == d_hits.tolist()
            assert np.allclose(accept[a], d_accept, atol=1e-5, rtol=0)
            lengths += d_len
            expected += d_exp
        assert sums["accepted_length"][0] == lengths
        assert abs(sums["expected_accepted_length"][0] - expected) < 1e-4


def test_dflash_rows_equal_each_block_run_alone(target, text, tmp_path):
    model = load_dflash(write_tiny_dflash(tmp_path, target, seed=2, block_size=BS), target)
    drafter = DFlashAdapter(model, target, tokenizer=None)
    anchors, _ = block_anchors(np.array([16, T]), T, K, 4)
    rows = block_rows(drafter, text, SPECS, anchors, K, TEMP)

    def direct(name, p):
        proposer = drafter.proposer(SPECS[name])
        from calibrate.drafters.target import hidden_state_features
        feats = hidden_state_features(target, text, model.config.hidden_state_ids)
        proposer.start(text[:, :p], feats[:, :p], int(text[0, p]))  # a fresh drafter, this context only
        logits = proposer.block_logits()[:K]
        p_law, greedy = _target_law(target, text, torch.arange(p, p + K))
        return _direct(logits, p_law, greedy)

    _check(rows, anchors, direct)
    assert not np.allclose(rows["spec"][1], rows["none"][1])  # the scale acts past n_ref = 8


def test_pard_rows_equal_an_uncached_pass_over_text_and_masks(target, text):
    mask = 250
    model = tiny_target(5, num_layers=2)
    model.config.pard_token = mask
    drafter = _pard(model, target)
    anchors, _ = block_anchors(np.array([16, T]), T, K, 4)
    rows = block_rows(drafter, text, {"none": None}, anchors, K, TEMP)

    def direct(name, p):
        with torch.no_grad():
            logits = model(torch.cat((text[:, :p + 1], torch.full((1, K - 1), mask)), 1)).logits[0, -K:]
        p_law, greedy = _target_law(target, text, torch.arange(p, p + K))
        return _direct(logits, p_law, greedy)

    _check(rows, anchors, direct)


def _pard(model, target):
    """A pard adapter around ``model`` without a tokenizer (block_rows reads none)."""
    drafter = CausalLMAdapter.__new__(CausalLMAdapter)
    drafter.model, drafter.kind, drafter._target = model, "pard", target
    drafter.device = torch.device("cpu")
    drafter.info = type("Info", (), {"path": None})()
    return drafter


def test_summary_pairs_the_arms_over_sequences():
    rng = np.random.default_rng(0)
    units = []
    for _ in range(4):
        rows = {name: (rng.random((6, K)) < 0.6, rng.random((6, K))) for name in ("none", "spec")}
        units.append(block_sums(rows, np.repeat([0, 1], 3), 2))
    out = summarize_blocks(units, ["none", "spec"], np.array([16, 32]), K, 3)
    cell = out["buckets"][0]["spec"]
    assert len(cell["agreement_by_position"]) == K and cell["accepted_length_interval"][0] <= cell["accepted_length"]
    assert len(cell["delta_vs_none"]["expected_accepted_length"]) == 3
    assert out["buckets"][1]["anchors"] == 12 and "none" in out["buckets"][1]


@pytest.mark.parametrize("edit,message", [
    (lambda u: u.pop("spec"), "one entry per arm"),
    (lambda u: u["none"].__setitem__("agreement", [[1.0] * (K + 1)] * 2), "none.agreement"),
    (lambda u: u.__setitem__("anchors", [-1, 3]), "anchors"),
    (lambda u: u["spec"].__setitem__("accepted_length", ["x", 1]), "spec.accepted_length"),
    (lambda u: u.__setitem__("none", []), "none.agreement"),
])
def test_a_damaged_saved_unit_is_refused(edit, message):
    rows = {name: (np.ones((2, K), dtype=bool), np.ones((2, K))) for name in ("none", "spec")}
    unit = block_sums(rows, np.array([0, 1]), 2)
    check_block_unit(unit, ["none", "spec"], 2, K)
    edit(unit)
    with pytest.raises(ValueError, match=message):
        check_block_unit(unit, ["none", "spec"], 2, K)


def test_a_text_too_short_for_an_anchor_measures_nothing():
    anchors, buckets = block_anchors(np.array([4]), 4, 3, 16)  # p + 3 must stay inside 4 tokens from p = 1
    assert len(anchors) == 0
    rows = block_rows(None, torch.zeros(1, 4, dtype=torch.long), {"none": None}, anchors, 3)
    sums = block_sums(rows, buckets, 1)
    assert sums["anchors"] == [0] and sums["none"]["accepted_length"] == [0.0]
