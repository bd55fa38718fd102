"""The measurement engine (``calibrate.measure``): expected acceptance, tallies, the oracle, resume.

Expected acceptance is held to a float64 computation written here from its definition; tallies to
the adapter's own outputs; the oracle to one target pass per sequence whatever the number of arms.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.drafters.eagle3 import Eagle3Adapter, load_eagle3_head
from calibrate.eval.options import EvalOptions
from calibrate.eval.run import evaluate
from calibrate.measure import Arm, NextTokenLaw, SavedUnits, expected_acceptance, gain, summarize, tally_sequence
from sharpdraft_theory import ScaleSpec
from sharpdraft_theory.bootstrap import paired_bootstrap

from test_eval import ByteTokenizer, SPEC, corpus  # noqa: F401 (corpus: a fixture)
from tiny_checkpoints import tiny_target, write_tiny_eagle3

pytestmark = pytest.mark.usefixtures("one_thread")


def _float64_acceptance(target_logits, draft_logits, temperature, columns=None):
    """sum_x min(p_T(x), q_T(x)), p over the whole target vocabulary, q zero off the drafter's columns."""
    p = torch.softmax(target_logits.double() / temperature, -1)
    q = torch.zeros_like(p)
    cols = torch.arange(draft_logits.shape[1]) if columns is None else columns
    q[:, cols] = torch.softmax(draft_logits.double() / temperature, -1)
    return torch.minimum(p, q).sum(-1)


logits = st.lists(st.floats(-20, 20), min_size=6, max_size=6)


@given(st.lists(logits, min_size=1, max_size=3), st.lists(logits, min_size=1, max_size=3),
       st.floats(0.05, 20.0), st.booleans())
def test_expected_acceptance_is_the_float64_definition(target_rows, draft_rows, temperature, subset):
    rows = min(len(target_rows), len(draft_rows))
    target = torch.tensor(target_rows[:rows])
    if subset:  # a sub-vocabulary drafter (EAGLE-3's d2t): columns 1, 3, 4 of the target
        columns = torch.tensor([1, 3, 4])
        draft = torch.tensor(draft_rows[:rows])[:, :3]
    else:
        columns, draft = None, torch.tensor(draft_rows[:rows])
    got = expected_acceptance(target, draft, temperature, columns).double()
    # float32 softmax of logits up to 20 / 0.05 = 400 in magnitude: relative 1e-6 per term, 6 terms
    torch.testing.assert_close(got, _float64_acceptance(target, draft, temperature, columns), rtol=0, atol=1e-5)


def test_expected_acceptance_limits():
    """Equal laws accept surely; at a low temperature it becomes greedy agreement; disjoint laws never."""
    g = torch.Generator().manual_seed(0)
    target, draft = torch.randn(50, 30, generator=g) * 3, torch.randn(50, 30, generator=g) * 3
    assert torch.allclose(expected_acceptance(target, target, 1.0), torch.ones(50))
    agree = (target.argmax(-1) == draft.argmax(-1)).float()
    assert 0 < agree.sum() < 50  # not vacuous
    torch.testing.assert_close(expected_acceptance(target, draft, 1e-3), agree, rtol=0, atol=1e-4)
    # a drafter whose only column (id 2) the target gives no mass: nothing is ever accepted
    assert float(expected_acceptance(torch.tensor([[0.0, 0, -1e4, -1e4]]), torch.tensor([[0.0]]), 1.0,
                                     torch.tensor([2]))) < 1e-30


def test_law_chunks_agree_with_one_pass(monkeypatch):
    """Rows are processed in chunks; the chunk size changes nothing."""
    import calibrate.measure.metrics as metrics

    g = torch.Generator().manual_seed(1)
    target, draft = torch.randn(37, 11, generator=g), torch.randn(37, 11, generator=g)
    whole = NextTokenLaw(target, 0.7).acceptance(draft)
    monkeypatch.setattr(metrics, "_CHUNK", 5)
    assert torch.equal(NextTokenLaw(target, 0.7).acceptance(draft), whole)


def test_bucket_averaged_bootstrap_is_the_average_of_bucket_ratios():
    rng = np.random.default_rng(0)
    num, den = rng.normal(size=(6, 3)), rng.integers(5, 10, size=(6, 3)).astype(float)
    one = paired_bootstrap(num[:, 1], den[:, 1])
    assert paired_bootstrap(num[:, 1:2], den[:, 1:2]) == one  # one bucket: the 1-D statistic, same resamples
    w = np.array([1.0, 2.0, 1.0])
    mean = sum(wi * num[:, b].sum() / den[:, b].sum() for b, wi in enumerate(w)) / w.sum()
    got = paired_bootstrap(num, den, weights=w)
    assert got[0] == pytest.approx(mean, rel=1e-12) and got[1] < got[0] < got[2]


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    target = tiny_target(0)
    head = load_eagle3_head(write_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), target, seed=1), target)
    return Eagle3Adapter(head, target, ByteTokenizer())


def test_tally_is_the_adapters_rows(drafter):
    """Per-bucket sums equal the adapter's own per-row outputs bucketed by hand."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 256, (1, 100), generator=g)
    edges = np.array([32, 64, 100])
    spec = ScaleSpec(law="log-linear", n_ref=32, slope=0.8, top_k=2)
    arms = [Arm("none"), Arm("spec", spec)]
    tally = tally_sequence(drafter, ids, arms, edges, top_k=2, temperature=0.8)
    forced = drafter.teacher_forced(ids, [(None, None), (spec, None)], temperature=0.8)
    n = np.arange(1, forced.drafted.shape[1] + 1)
    bucket = np.searchsorted(edges, n)
    for j, arm in enumerate(arms):
        hits = (forced.drafted[j] == forced.target_next).numpy()
        for b in range(3):
            assert tally.sums[arm.name]["agreement"][b] == hits[bucket == b].sum()
            assert tally.sums[arm.name]["expected_acceptance"][b] == pytest.approx(
                forced.accept[j].double().numpy()[bucket == b].sum(), rel=1e-12)
    assert tally.sums["spec"]["expected_acceptance"][2] != tally.sums["none"]["expected_acceptance"][2]
    assert tally.sums["spec"]["expected_acceptance"][0] == tally.sums["none"]["expected_acceptance"][0]  # n <= n_ref
    # round trip, as a resumed run reads it
    again = type(tally).from_dict(json.loads(json.dumps(tally.to_dict())), list(tally.sums), len(tally.rows))
    assert summarize([again], arms, edges) == summarize([tally], arms, edges)


def test_an_oracle_grid_shares_one_target_pass(drafter, corpus):  # noqa: F811
    """Every arm of the grid runs on the rows of one target pass per sequence."""
    calls = []
    handle = drafter.target.get_decoder().register_forward_hook(lambda *a: calls.append(1))
    try:
        r = evaluate(drafter, EvalOptions(spec=SPEC, lengths=[32, 64, 128], corpus=corpus, sequences=2,
                                          rows_per_bucket=8, variants=("none", "spec"), slopes=(0.1, 0.3, 0.6),
                                          alphas=(0.9, 1.2)))
    finally:
        handle.remove()
    assert len(calls) == 2  # two sequences, one target forward each, for 7 arms
    oracle = r["oracle"]
    assert oracle["buckets"] == [128] and set(oracle["gains"]) == {"slope 0.1", "slope 0.3", "slope 0.6",
                                                                  "alpha 0.9", "alpha 1.2"}
    assert oracle["best"] == max(oracle["gains"], key=lambda a: oracle["gains"][a]["agreement"][0])
    for row in r["buckets"][:2]:  # n <= n_ref = 64: every scale is the identity
        for arm in oracle["gains"]:
            assert row[arm]["delta_vs_none"]["agreement"] == [0.0, 0.0, 0.0]
    assert r["variants"]["alpha 1.2"]["alpha"] == 1.2


def test_gain_over_buckets_matches_summary_for_one_bucket(drafter, corpus):  # noqa: F811
    edges = np.array([32, 64, 128])
    arms = [Arm("none"), Arm("spec", SPEC)]
    texts = [torch.randint(1, 256, (1, 128), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    tallies = [tally_sequence(drafter, t, arms, edges, top_k=2) for t in texts]
    assert gain(tallies, "spec", np.array([2])) == summarize(tallies, arms, edges)[2]["spec"]["delta_vs_none"][
        "agreement"]


def test_resume_gives_the_same_result(drafter, corpus, tmp_path, monkeypatch):  # noqa: F811
    """A run stopped after its first sequence, resumed, writes what an uninterrupted run writes."""
    import calibrate.eval.run as ev

    opts = EvalOptions(spec=SPEC, lengths=[32, 64, 128], corpus=corpus, sequences=3, rows_per_bucket=8,
                       variants=("none", "spec", "window"), slopes=(0.2,))
    whole = evaluate(drafter, opts)
    real, done = ev.tally_sequence, []

    def dies_after_one(*a, **k):
        if done:
            raise KeyboardInterrupt
        done.append(1)
        return real(*a, **k)

    folder = tmp_path / "r.json.partial"
    monkeypatch.setattr(ev, "tally_sequence", dies_after_one)
    with pytest.raises(KeyboardInterrupt):
        evaluate(drafter, opts, saved=SavedUnits(folder, {"a": 1}, resume=False))
    assert sorted(p.name for p in folder.iterdir()) == ["forced-00000.json", "run.json"]
    monkeypatch.setattr(ev, "tally_sequence", real)
    saved = SavedUnits(folder, {"a": 1}, resume=True)
    resumed = evaluate(drafter, opts, saved=saved)
    assert saved.resumed == 1

    def measured(r):  # wall times and peak memory differ from run to run: the rest must not
        return {k: v for k, v in r.items() if k != "costs"}

    assert measured(resumed) == measured(whole) and list(resumed["costs"]) == list(whole["costs"])
    from calibrate.errors import UserError
    with pytest.raises(UserError, match="pass --resume"):
        SavedUnits(folder, {"a": 1}, resume=False)
    with pytest.raises(UserError, match="a does not match"):
        SavedUnits(folder, {"a": 2}, resume=True)


def test_eval_cli_reports_expected_acceptance_and_the_oracle(tmp_path, corpus):  # noqa: F811
    """Through the command: the JSON holds the temperature, the metric and the oracle; no partial folder stays."""
    from test_calibrate import _write_causal_lm

    drafter_path, target_path = _write_causal_lm(tmp_path / "drafter"), _write_causal_lm(tmp_path / "target")
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["eval", "--drafter", "hf", "--drafter-path", str(drafter_path), "--target-path",
                                      str(target_path), "--corpus", corpus, "--lengths", "32,64,128", "--n-ref", "64",
                                      "--sequences", "2", "--slopes", "0.1,0.4", "--temperature", "0.7",
                                      "--variants", "none,spec", "--out", str(out), "--threads", "1"])
    assert result.exit_code == 0, result.output
    r = json.loads(out.read_text())
    assert r["temperature"] == 0.7 and r["oracle"]["best"] in ("slope 0.1", "slope 0.4")
    for row in r["buckets"]:
        assert 0 < row["spec"]["expected_acceptance"] <= 1
    assert not (tmp_path / "r.json.partial").exists()  # removed once the result is written
