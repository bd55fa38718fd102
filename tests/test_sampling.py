"""Speculative sampling: the verification rule keeps the target's law, alone and inside the loops.

* The rule alone (``sharpdraft_theory.sampling``), exactly in float64: the law of the emitted token
  is ``p`` for any ``p``, ``q``.
* The chain loop (``calibrate.speculative.speculative_generate`` with a ``Sampling`` rule) on a
  tiny target: the law of the tokens the verification emits, by a fixed-seed Monte Carlo against
  the target's own law; wrong rules run through the same Monte Carlo fail it.
* transformers' assisted sampling: the ``q`` and ``p`` its rejection step is handed are the
  assistant's and the target's untruncated ``softmax(logits / T)``.
* ``evaluate(..., sample=True)`` and ``sharpdraft eval --speculative --sample``.
"""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

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
from calibrate.speculative import GREEDY, Sampling, prefill, speculative_generate
from sharpdraft_theory import ScaleSpec
from sharpdraft_theory.sampling import (acceptance_rate, accept_probability, emitted_law, inverse_cdf, residual,
                                        softmax)

from assisted_generation import transformers_generate
from test_assisted import copy_drafter_eval
from test_eval import LENGTHS, ByteTokenizer
from tiny_checkpoints import tiny_target, write_tiny_eagle3

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

LAW_TOL = 1e-12  # float64 sums over <= 12 terms of numbers <= 1: a few ulps, far below 1e-12


# -- the rule alone, exactly --------------------------------------------------------------------

def _law(weights: list[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum()


# weights in [0, 1] with some exact zeros, at least one positive: every support pattern occurs
laws = st.integers(2, 12).flatmap(lambda v: st.tuples(
    st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1.0)), min_size=v, max_size=v).filter(any),
    st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1.0)), min_size=v, max_size=v).filter(any)))


@given(laws)
def test_emitted_law_is_the_target_law(pair):
    p, q = _law(pair[0]), _law(pair[1])
    np.testing.assert_allclose(emitted_law(p, q), p, rtol=0, atol=LAW_TOL)
    # one draft is accepted with probability sum min(p, q) = sum_x q(x) min(1, p(x) / q(x))
    assert acceptance_rate(p, q) == pytest.approx(float((q * accept_probability(p, q)).sum()), abs=LAW_TOL)


@pytest.mark.parametrize("p, q", [
    ([0.5, 0.5, 0.0], [1.0, 0.0, 0.0]),  # q(x) = 0 where p(x) > 0: only the residual reaches token 1
    ([0.2, 0.3, 0.5], [0.2, 0.3, 0.5]),  # p = q: every draft accepted
    ([0.6, 0.4, 0.0, 0.0], [0.0, 0.0, 0.7, 0.3]),  # disjoint supports: every draft rejected
    ([1.0, 0.0], [0.5, 0.5]),  # a one-hot target
], ids=["q-zero", "p-equals-q", "disjoint", "one-hot"])
def test_emitted_law_edge_cases(p, q):
    p, q = np.array(p), np.array(q)
    np.testing.assert_allclose(emitted_law(p, q), p, rtol=0, atol=LAW_TOL)


def test_edge_cases_take_the_right_branch():
    p, q = np.array([0.2, 0.3, 0.5]), np.array([0.2, 0.3, 0.5])
    assert np.all(accept_probability(p, q) == 1.0) and acceptance_rate(p, q) == pytest.approx(1.0, abs=LAW_TOL)
    p, q = np.array([0.6, 0.4, 0.0, 0.0]), np.array([0.0, 0.0, 0.7, 0.3])
    assert acceptance_rate(p, q) == 0.0 and np.array_equal(residual(p, q), p)
    assert np.array_equal(residual(np.array([0.5, 0.5, 0.0]), np.array([1.0, 0.0, 0.0])), [0.0, 1.0, 0.0])


@given(laws)
def test_a_wrong_residual_changes_the_law(pair):
    """Redrawing from ``p`` after a rejection (a common slip) gives ``min(p, q) + (1 - beta) p``, which is
    ``p`` only where ``min(p, q)`` is proportional to ``p`` (p = q, disjoint supports, a one-hot p):
    the law check above tells the two apart everywhere else, so it can fail."""
    p, q = _law(pair[0]), _law(pair[1])
    kept = q * accept_probability(p, q)
    wrong = kept + (1.0 - kept.sum()) * p
    gap = np.abs(np.minimum(p, q) - acceptance_rate(p, q) * p).sum()
    if gap > 1e-9:
        assert np.abs(wrong - p).max() > 1e3 * LAW_TOL


def test_inverse_cdf_draws_each_token_with_its_probability():
    """Uniforms on an even grid of N points land on token i about N p(i) times (within 1 of it);
    zero-probability tokens never."""
    probs = np.array([0.0, 0.25, 0.0, 0.5, 0.125, 0.125, 0.0])
    n = 4096
    counts = np.bincount([inverse_cdf(probs, (j + 0.5) / n) for j in range(n)], minlength=len(probs))
    assert np.all(np.abs(counts - n * probs) <= 1) and np.all(counts[probs == 0] == 0)
    assert inverse_cdf(probs, np.nextafter(1.0, 0.0)) == 5  # u just below 1: the last token that can be drawn


def test_softmax_temperature():
    logits = np.array([1.0, 2.0, -np.inf])
    np.testing.assert_allclose(softmax(logits, 0.5), [np.exp(2) / (np.exp(2) + np.exp(4)),
                                                      np.exp(4) / (np.exp(2) + np.exp(4)), 0.0], rtol=1e-15)


@pytest.mark.parametrize("temperature", [0.0, -1.0, math.nan, math.inf])
def test_sampling_refuses_bad_temperatures(temperature):
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature, 0)


# -- the chain loop: Monte Carlo against the target's law ----------------------------------------

V = 4  # tiny vocabulary: the law of two tokens has 16 cells
T = 0.8  # both distributions at T != 1, so a temperature applied to one side only would show
PROMPT = torch.tensor([[1, 2, 3]])
RUNS = 6000
# Bretagnolle-Huber-Carol: P(TV(empirical, law) >= eps) <= 2^cells exp(-2 N eps^2). With 16 cells,
# N = 6,000 and a failure chance of 1e-6 for a correct loop under a random seed, eps = 0.0456; the
# seeds here are fixed, so the test cannot flake, and the bound says a correct loop passes it. (At
# N = 20,000 the correct rule measured 0.007, the wrong rules below 0.099 and 0.207.)
CELLS, DELTA = V * V, 1e-6
TV_BOUND = math.sqrt((CELLS * math.log(2) + math.log(1 / DELTA)) / (2 * RUNS))


def print_summary(seed: int, scale: float) -> torch.Tensor:
    return scale * torch.randn(V, V, generator=torch.Generator().manual_seed(seed))  # (V, V) logits after each token


class MarkovTarget(torch.nn.Module):
    """A target whose logits after token ``t`` are row ``t`` of a fixed table, behind the causal-LM
    forward the loop calls (its transformers cache stays empty: nothing to keep). Its law of any
    continuation is a product of table rows, exact in closed form, and a decode costs microseconds,
    so the Monte Carlo can afford tens of thousands of runs."""

    def __init__(self):
        super().__init__()
        self.table = print_summary(1, 1.5)

    def forward(self, input_ids, use_cache=True, past_key_values=None, output_hidden_states=False):
        return SimpleNamespace(logits=self.table[input_ids])  # (1, T, V)


class TableDrafter:
    """A ``Proposer`` with another, sharper table: its law is far from the target's, so a wrong
    rule shows."""

    name = "test"
    feature_ids = None

    def __init__(self):
        self.table = print_summary(0, 3.0)

    def start(self, prompt, features, pending: int) -> None:
        self.last = pending

    def propose(self, k: int, rule):
        drafts, laws, last = [], [], self.last
        for _ in range(k):
            last, law = rule.pick(self.table[last])
            drafts.append(last)
            laws.append(law)
        return drafts, None if laws[0] is None else np.stack(laws)

    def commit(self, new, features) -> None:
        self.last = new[-1]

    def close(self) -> None:
        pass


class ResidualIsTarget(Sampling):
    """Wrong: after a rejection, redraw from the target's ``p`` instead of the residual."""

    def verify(self, drafts, q, logits):
        for i, x in enumerate(drafts):
            p = self.probs(logits[i])
            if not self.rng.random() < accept_probability(p[x], q[i, x]):
                return i, inverse_cdf(p, self.rng.random())
        return len(drafts), inverse_cdf(self.probs(logits[len(drafts)]), self.rng.random())


class GreedyAcceptance(Sampling):
    """Wrong: sampled drafts accepted when they equal the target's argmax, the target's draws after."""

    def verify(self, drafts, q, logits):
        accepted, _ = GREEDY.verify(drafts, q, logits)
        return accepted, inverse_cdf(self.probs(logits[accepted]), self.rng.random())


class AcceptAll(Sampling):
    """Wrong: every draft accepted, then the target's draw."""

    def verify(self, drafts, q, logits):
        return len(drafts), inverse_cdf(self.probs(logits[len(drafts)]), self.rng.random())


def exact_law(target: MarkovTarget) -> tuple[np.ndarray, np.ndarray]:
    """The target sampling alone at T after ``PROMPT``: the law of token 0 (V,) and of tokens 1 and 2
    (V, V), ``sum_t0 p(t0) P[t0, t1] P[t1, t2]``, float64."""
    P = softmax(target.table.double().numpy(), T)  # (V, V) row t: the law after token t
    p0 = P[int(PROMPT[0, -1])]
    return p0, np.einsum("a,ab,bc->bc", p0, P, P)


def monte_carlo(rule_class, num_draft: int, drafter=None) -> tuple[np.ndarray, np.ndarray]:
    """Empirical laws of token 0 (V,) and of tokens 1 and 2 (V, V) over ``RUNS`` decodes by the chain
    loop with ``drafter`` (default a :class:`TableDrafter`), run ``i`` with its own stream seeded ``(0, i)``."""
    target, drafter = MarkovTarget(), drafter or TableDrafter()
    shared = prefill(target, PROMPT)
    first, pair = np.zeros(V), np.zeros((V, V))
    for i in range(RUNS):
        out = speculative_generate(target, drafter, PROMPT, 3, num_draft, shared, rule_class(T, (0, i)))
        first[out.tokens[0]] += 1
        pair[out.tokens[1], out.tokens[2]] += 1
    return first / RUNS, pair / RUNS


def _tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a - b).sum())


@pytest.mark.parametrize("num_draft", [1, 2], ids=["K1-bonus", "K2-chained"])
def test_chain_loop_keeps_the_target_law(num_draft):
    """Token 0 comes from the prefill, tokens 1 and 2 from verification: with K = 1 token 2 is the bonus
    draw whenever the draft is kept; with K = 2 it is the second draft, drawn after the first."""
    p0, law = exact_law(MarkovTarget())
    first, pair = monte_carlo(Sampling, num_draft)
    assert _tv(first, p0) < TV_BOUND  # 4 cells: a looser event than the 16-cell bound allows for
    assert _tv(pair, law) < TV_BOUND, f"total variation {_tv(pair, law):.4f} >= {TV_BOUND:.4f}"
    # the drafter really differs from the target: after 3 of the 4 tokens a draft is kept at most 2 times in 3
    q = softmax(TableDrafter().table.double().numpy(), T)
    assert np.sort(acceptance_rate(softmax(MarkovTarget().table.double().numpy(), T), q))[2] < 0.7


@pytest.mark.parametrize("rule_class", [ResidualIsTarget, GreedyAcceptance])
def test_a_wrong_rule_fails_the_monte_carlo(rule_class):
    """The same Monte Carlo with a wrong rule lands outside the bound: the test above can fail."""
    _, law = exact_law(MarkovTarget())
    tv = _tv(monte_carlo(rule_class, 1)[1], law)
    assert tv > TV_BOUND, f"total variation {tv:.4f}"


class BlockTableDrafter(TableDrafter):
    """A block drafter (DFlash's way): all drafts from one call, row ``j`` drawn from its own law, which
    depends on the pending token and ``j`` only, never on the rows drawn before it in the block."""

    name = "block"

    def __init__(self):
        super().__init__()
        self.rows = [print_summary(7 + j, 2.0) for j in range(2)]  # (V, V) per block row

    def propose(self, k: int, rule):
        drafts, laws = [], []
        for j in range(k):
            token, law = rule.pick(self.rows[j][self.last])
            drafts.append(token)
            laws.append(law)
        return drafts, None if laws[0] is None else np.stack(laws)


def test_block_drafts_in_the_chain_loop_keep_the_target_law():
    """Block drafting through the same loop, K = 2 drafts per call: token 2 is the block's second row,
    drawn without seeing the first; the per-position rule still gives the target's law. Accepting
    every draft lands outside the bound, so this test can fail."""
    p0, law = exact_law(MarkovTarget())
    first, pair = monte_carlo(Sampling, 2, BlockTableDrafter())
    assert _tv(first, p0) < TV_BOUND
    assert _tv(pair, law) < TV_BOUND, f"total variation {_tv(pair, law):.4f} >= {TV_BOUND:.4f}"
    tv = _tv(monte_carlo(AcceptAll, 2, BlockTableDrafter())[1], law)
    assert tv > TV_BOUND, f"total variation {tv:.4f}"


# -- EAGLE-3: the head's draft laws --------------------------------------------------------------

@pytest.fixture(scope="module")
def eagle3(tmp_path_factory):
    target = tiny_target(0)
    head = load_eagle3_head(write_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), target, seed=1), target)
    return Eagle3Adapter(head, target, ByteTokenizer())


def test_eagle3_drafts_from_its_law_over_the_draft_vocabulary(eagle3):
    """Each draft's law is ``softmax(head logits / T)`` over the draft vocabulary, placed at the target
    ids (zero elsewhere); every draft lies in it."""
    head, target = eagle3.head, eagle3.target
    prompt = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    shared = prefill(target, prompt, eagle3.feature_ids)
    chain = eagle3.proposer(None)
    with torch.no_grad():
        chain.start(prompt, shared.features, 7)
        first_logits = chain.logits.clone()  # the head's logits for the first draft (draft vocabulary)
        drafts, q = chain.propose(3, Sampling(0.7, 5))
    used = head.draft_to_target(torch.arange(head.config.draft_vocab_size)).numpy()
    assert q.shape == (3, head.config.vocab_size)
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=0, atol=1e-12)
    off = np.ones(head.config.vocab_size, bool)
    off[used] = False
    assert np.all(q[:, off] == 0) and all(q[j, x] > 0 for j, x in enumerate(drafts))
    np.testing.assert_allclose(q[0, used], softmax(first_logits.double().numpy(), 0.7), rtol=0, atol=1e-12)


def test_eagle3_sampling_repeats_with_its_seed(eagle3):
    prompt = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(2))

    def run(seed):
        out = speculative_generate(eagle3.target, eagle3.proposer(None), prompt, 16, 3, rule=Sampling(1.0, seed))
        return out.tokens, out.accepted

    assert run(3) == run(3)
    assert run(3) != run(4)


# -- transformers' assisted sampling ---------------------------------------------------------------

def test_transformers_assisted_sampling_is_rejection_sampling(monkeypatch):
    """Every verification in ``generate(assistant_model=..., do_sample=True)`` goes through
    transformers' ``_speculative_sampling`` with ``q`` the assistant's and ``p`` the target's plain
    ``softmax(logits / T)`` (no top-k: the vocabulary is 256, above transformers' default 50)."""
    import transformers.generation.utils as gen

    target, assistant = tiny_target(0), tiny_target(3, num_layers=2)
    calls = []
    original = gen._speculative_sampling

    def spy(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs):
        calls.append((candidate_input_ids.clone(), candidate_logits.clone(), candidate_length, new_logits.clone()))
        return original(candidate_input_ids, candidate_logits, candidate_length, new_logits, **kwargs)

    monkeypatch.setattr(gen, "_speculative_sampling", spy)
    prompt = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    out = transformers_generate(target, prompt, 12, assistant, 3, Sampling(0.7, 0))
    # a last round with room for the bonus token only drafts nothing, and samples the target alone
    assert len(calls) in (out.steps, out.steps - 1) and len(calls) > 1
    for ids, candidate_logits, k, new_logits in calls:
        with torch.no_grad():
            q = torch.softmax(assistant(input_ids=ids).logits[0, -k - 1:-1].double() / 0.7, -1)
            p = torch.softmax(target(input_ids=ids).logits[0, -k - 1:].double() / 0.7, -1)
        # float32 logits from cached and uncached forwards: probabilities agree to ~1e-6
        torch.testing.assert_close(torch.softmax(candidate_logits[0].double(), -1), q, rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.softmax(new_logits[0].double(), -1), p, rtol=0, atol=1e-5)


def test_transformers_sampling_repeats_with_its_seed_and_leaves_torch_alone():
    target, assistant = tiny_target(0), tiny_target(3, num_layers=2)
    prompt = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0))
    state = torch.random.get_rng_state()
    runs = [transformers_generate(target, prompt, 12, assistant, 3, Sampling(1.0, s)).tokens for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert torch.equal(torch.random.get_rng_state(), state)


# -- evaluate and the CLI --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = random.Random(0)
    words = ["query", "key", "mass", "attention", "drafter", "token", "the", "of", "a", "long", "context"]
    path = tmp_path_factory.mktemp("corpus") / "heldout.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(200)))
    return str(path)


def test_evaluate_samples_with_paired_streams(eagle3, corpus):
    spec = ScaleSpec(law="log-linear", n_ref=64, slope=0.5, top_k=2)
    r = evaluate(eagle3, EvalOptions(spec=spec, lengths=LENGTHS, corpus=corpus, sequences=2, rows_per_bucket=8,
                                     speculative=True, new_tokens=8, num_draft=3, sample=True, temperature=0.8, seed=0))
    s = r["speculative"]
    assert (s["verification"], s["temperature"], s["seed"], s["outputs_identical"]) == ("sampling", 0.8, 0, None)
    assert "does not apply" in s["outputs_identical_note"]
    for row in r["buckets"]:
        for variant in r["variants"]:
            cell = row[variant]
            assert 1.0 <= cell["acceptance_length"] <= 4.0 and cell["speedup"] > 0
            assert len(cell["acceptance_length_interval"]) == 2
        if row["n"] <= 64:  # every variant is the plain head, and draws the same stream: the same runs
            assert all(row[v]["acceptance_length"] == row["none"]["acceptance_length"] for v in r["variants"])
            assert all(row[v]["delta_vs_none"]["acceptance_length"] == [0.0, 0.0, 0.0] for v in r["variants"]
                       if v != "none")
    other = evaluate(eagle3, EvalOptions(spec=spec, lengths=LENGTHS, corpus=corpus, sequences=2, rows_per_bucket=8,
                                         speculative=True, new_tokens=8, num_draft=3, variants=["none"], sample=True,
                                         seed=1))
    assert [row["none"]["acceptance_length"] for row in other["buckets"]] != [
        row["none"]["acceptance_length"] for row in r["buckets"]]  # another seed, other draws: this test can fail


def test_eval_cli_samples_an_hf_drafter(tmp_path):
    """``sharpdraft eval --drafter hf --speculative --sample``: the drafter is a copy of the target, so
    q = p and every draft is kept (K + 1 per forward) where no variant changes it."""
    result = CliRunner().invoke(app, [
        *copy_drafter_eval(tmp_path), "--sample", "--temperature", "0.7", "--seed", "3", "--variants", "none,window",
        "--out", str(tmp_path / "eval.json")])
    assert result.exit_code == 0, result.output
    assert "sampling at temperature 0.7, seed 3" in result.output
    r = json.loads((tmp_path / "eval.json").read_text())
    s = r["speculative"]
    assert (s["loop"], s["verification"], s["temperature"], s["seed"]) == ("sharpdraft-chain", "sampling", 0.7, 3)
    assert s["outputs_identical"] is None
    for row in r["buckets"]:
        assert row["none"]["acceptance_length_interval"] is not None
        if row["n"] <= 64:
            assert row["none"]["acceptance_length"] == row["window"]["acceptance_length"] == 4.0
