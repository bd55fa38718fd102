"""The conformance grid: every proposer, greedy and sampled, under every deployable spec kind, through the one loop.

Each cell decodes with ``calibrate.speculative.speculative_generate`` on tiny random checkpoints of an
8-token vocabulary (small enough that prompt lookup and the copy pointer find matches, and that a law
over it can be estimated) and is checked against target-only decoding, the same loop with
``NoProposer``:

* greedy: the output equals target-only greedy decoding, token for token;
* sampled, exactly: every draft was drawn from the law the proposer hands the rule (the pick's law, or
  a point mass for lookup), so the rule's own proof (tests/test_sampling.py) applies;
* sampled, end to end: the law of the first two verified tokens, by a fixed-seed Monte Carlo, is the
  target's own law, within the Bretagnolle-Huber-Carol bound tests/test_sampling.py uses; the same
  Monte Carlo with a rule that accepts every draft lands outside it (the check can fail).

Proposers: the EAGLE-3 chain, DFlash blocks, PARD's parallel drafts, a causal LM's chain (``hf``), each
model kind with a copy pointer around it (``hf`` takes one here, though its loader refuses one yet), prompt lookup alone and before a model, and the
proposer that proposes nothing. Spec kinds: none, the scale laws (log-linear, Qwen's logn), a window,
sinks, and the three distance fixes; lookup and the empty proposer run no model, so they take none.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from calibrate.drafters.dflash import DFlashAdapter, load_dflash
from calibrate.drafters.eagle3 import Eagle3Adapter, load_eagle3_head
from calibrate.drafters.hf import CausalLMAdapter
from calibrate.drafters.pointer import CopyPointer
from calibrate.eval.variants import variant_specs
from calibrate.lookup import LookupProposer, LookupSettings
from calibrate.speculative import NoProposer, Sampling, greedy_generate, prefill, speculative_generate
from sharpdraft_theory import ScaleSpec
from sharpdraft_theory.positions import FIXES
from sharpdraft_theory.sampling import inverse_cdf, softmax

from test_eval import ByteTokenizer
from tiny_checkpoints import tiny_target, write_tiny_dflash, write_tiny_eagle3

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

V = 8  # the vocabulary: lookup and the pointer match often, and a law over it is 8 cells
N_REF = 8
NUM_DRAFT = 2  # a DFlash block of 3 drafts 2 a forward
SPECS = variant_specs(ScaleSpec(law="log-linear", n_ref=N_REF, slope=0.5, top_k=2), N_REF,
                      ("none", "spec", "qwen-logn", "window", "sinks", *FIXES), longest=32)
POINTER = CopyPointer(2, 6.0, 3.0, 0.9)
MODELS = ("eagle3", "eagle3+pointer", "dflash", "dflash+pointer", "pard", "pard+pointer", "hf", "hf+pointer",
          "lookup+eagle3", "lookup+hf")
CELLS = [(name, spec) for name in MODELS for spec in SPECS] + [("lookup", "none"), ("none", "none")]
IDS = [f"{name}-{spec}" for name, spec in CELLS]


@pytest.fixture(scope="module")
def target():
    return tiny_target(0, num_layers=7, vocab_size=V)


@pytest.fixture(scope="module")
def adapters(target, tmp_path_factory):
    """name -> drafter adapter; each adapter with a pointer shares the weights of the one without."""
    head = load_eagle3_head(write_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), target, seed=1, draft_vocab_size=6),
                            target)
    block = load_dflash(write_tiny_dflash(tmp_path_factory.mktemp("dflash"), target, seed=2, block_size=3), target)
    pard = tiny_target(5, num_layers=2, vocab_size=V)
    pard.config.pard_token = V - 1
    hf = tiny_target(3, num_layers=2, vocab_size=V)

    def causal(model, kind, pointer=None):
        return CausalLMAdapter(model, ByteTokenizer(), kind=kind, path=None, default_n_ref=N_REF, target=target,
                               pointer=pointer)

    return {"eagle3": Eagle3Adapter(head, target, None), "eagle3+pointer": Eagle3Adapter(head, target, None,
                                                                                         pointer=POINTER),
            "dflash": DFlashAdapter(block, target, None), "dflash+pointer": DFlashAdapter(block, target, None,
                                                                                         pointer=POINTER),
            "pard": causal(pard, "pard"), "pard+pointer": causal(pard, "pard", POINTER),
            "hf": causal(hf, "hf"), "hf+pointer": causal(hf, "hf", POINTER)}


def make(adapters, name: str, spec):
    """The proposer of a grid cell."""
    if name == "none":
        return NoProposer()
    if name.startswith("lookup"):
        inner = name.removeprefix("lookup").removeprefix("+")
        return LookupProposer(V, LookupSettings(), make(adapters, inner, spec) if inner else None)
    return adapters[name].proposer(spec)


def prompts() -> list[torch.Tensor]:
    """A random prompt, and one that repeats itself (lookup and the pointer copy from it)."""
    g = torch.Generator().manual_seed(0)
    half = torch.randint(0, V, (1, 7), generator=g)
    return [torch.randint(0, V, (1, 13), generator=g), torch.cat((half, half), dim=1)]


@pytest.fixture(scope="module")
def references(target):
    return [greedy_generate(target, prompt, 14).tokens for prompt in prompts()]


# -- greedy: token for token -------------------------------------------------------------------------

@pytest.mark.parametrize("name, spec", CELLS, ids=IDS)
def test_greedy_equals_target_only_decoding(target, adapters, references, name, spec):
    for prompt, reference in zip(prompts(), references):
        proposer = make(adapters, name, SPECS[spec])
        try:
            out = speculative_generate(target, proposer, prompt, 14, NUM_DRAFT, prefill(target, prompt,
                                                                                        proposer.feature_ids))
        finally:
            proposer.close()
        assert out.tokens == reference
        assert all(0 <= a <= NUM_DRAFT for a in out.accepted) and out.drafter == proposer.name


def test_the_grid_drafts(target, adapters):
    """Not vacuous: on the repeating prompt lookup, the pointer and the models have drafts accepted."""
    prompt = prompts()[1]
    for name in ("lookup", "eagle3+pointer", "dflash+pointer", "pard+pointer"):
        out = speculative_generate(target, make(adapters, name, None), prompt, 14, NUM_DRAFT)
        assert sum(out.accepted) > 0, name


# -- sampled: drafts come from the laws the rule is given ---------------------------------------------

class Picks(Sampling):
    """Speculative sampling that keeps the law and the token of every pick."""

    def __init__(self, temperature, seed):
        super().__init__(temperature, seed)
        self.picks = []

    def pick(self, logits):
        token, law = super().pick(logits)
        self.picks.append((token, law))
        return token, law


class Drawn:
    """A proposer wrapper that checks each step's laws against the picks made while proposing: a drafted
    token was picked from a law with the same values at the same probabilities (the pick's law may be over
    a draft vocabulary, the handed law over the target's), or, with no pick, its law is a point mass."""

    def __init__(self, inner, rule: Picks):
        self.inner, self.rule, self.steps = inner, rule, 0
        self.name, self.feature_ids = inner.name, inner.feature_ids

    def start(self, *args):
        self.inner.start(*args)

    def propose(self, k, rule):
        before = len(self.rule.picks)
        drafts, q = self.inner.propose(k, rule)
        picks = self.rule.picks[before:]
        assert len(drafts) <= k and (q is None) == (not drafts)
        if drafts:
            assert q.shape == (len(drafts), V)
            np.testing.assert_allclose(q.sum(-1), 1.0, rtol=0, atol=1e-9)
        if not picks:  # lookup: point masses at its drafts
            assert all(q[j, x] == 1.0 for j, x in enumerate(drafts))
        else:
            assert len(picks) == len(drafts)
            for j, (x, (index, law)) in enumerate(zip(drafts, picks)):
                assert q[j, x] == law[index] > 0
                np.testing.assert_array_equal(np.sort(q[j][q[j] > 0]), np.sort(law[law > 0]))
        self.steps += bool(drafts)
        return drafts, q

    def commit(self, new, features):
        self.inner.commit(new, features)

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("name, spec", CELLS, ids=IDS)
def test_sampled_drafts_come_from_the_laws_handed_to_the_rule(target, adapters, name, spec):
    for seed, prompt in enumerate(prompts()):
        rule = Picks(0.8, seed)
        proposer = Drawn(make(adapters, name, SPECS[spec]), rule)
        try:
            out = speculative_generate(target, proposer, prompt, 10, NUM_DRAFT, rule=rule)
        finally:
            proposer.close()
        assert len(out.tokens) == 10 and (proposer.steps > 0 or name == "none")


# -- sampled: the target's law, by Monte Carlo ----------------------------------------------------------

T = 0.8
RUNS = 300  # per proposer, the spec kinds taking turns (each keeps the target's law, so their mixture does)
# Bretagnolle-Huber-Carol over V cells: P(TV >= eps) <= 2^V exp(-2 N eps^2); a failure chance of 1e-6 for a
# correct loop under a random seed. The seeds are fixed, so the test cannot flake.
TV_BOUND = math.sqrt((V * math.log(2) + math.log(1e6)) / (2 * RUNS))


class AcceptAll(Sampling):
    """Wrong: every draft accepted, then the target's draw."""

    def verify(self, drafts, q, logits):
        return len(drafts), inverse_cdf(self.probs(logits[len(drafts)]), self.rng.random())


def exact_laws(target, prompt: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The target sampling alone at ``T`` after ``prompt``: the laws (V,) of its tokens 1 and 2 (token 0 comes
    from the prefill), float64 from uncached forwards over every continuation."""
    def law(ids: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            return softmax(target(input_ids=ids).logits[:, -1].double().numpy(), T)  # (batch, V)

    p0 = law(prompt)[0]
    tokens = torch.arange(V)
    p1 = law(torch.cat((prompt.expand(V, -1), tokens[:, None]), dim=1))  # (V, V): row t0
    pairs = torch.cartesian_prod(tokens, tokens)  # (V * V, 2): t0, t1
    p2 = law(torch.cat((prompt.expand(V * V, -1), pairs), dim=1)).reshape(V, V, V)
    first = p0 @ p1
    return first, np.einsum("a,ab,abc->c", p0, p1, p2)


def monte_carlo(target, adapters, name: str, rule_class=Sampling) -> tuple[np.ndarray, np.ndarray]:
    """Empirical laws of tokens 1 and 2 over ``RUNS`` decodes of 3 tokens from the repeating prompt, run ``i``
    with the spec kind ``i`` modulo their number and its own stream seeded ``(0, i)``."""
    prompt = prompts()[1]
    specs = list(SPECS.values()) if name in MODELS else [None]
    counts = np.zeros((2, V))
    shared = {}
    for i in range(RUNS):
        proposer = make(adapters, name, specs[i % len(specs)])
        key = proposer.feature_ids
        if key not in shared:
            shared[key] = prefill(target, prompt, key)
        try:
            out = speculative_generate(target, proposer, prompt, 3, NUM_DRAFT, shared[key], rule_class(T, (0, i)))
        finally:
            proposer.close()
        counts[0, out.tokens[1]] += 1
        counts[1, out.tokens[2]] += 1
    return counts / RUNS


def _tv(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a - b).sum())


@pytest.mark.parametrize("name", [*MODELS, "lookup", "none"])
def test_sampling_keeps_the_target_law(target, adapters, name):
    laws = exact_laws(target, prompts()[1])
    empirical = monte_carlo(target, adapters, name)
    for j in range(2):
        assert _tv(empirical[j], laws[j]) < TV_BOUND, f"token {j + 1}: total variation {_tv(empirical[j], laws[j]):.4f}"


def test_a_wrong_law_fails_the_monte_carlo(target, adapters):
    """The same Monte Carlo with every draft accepted: lookup's copies are not the target's law, so the
    check above can fail."""
    laws = exact_laws(target, prompts()[1])
    empirical = monte_carlo(target, adapters, "lookup", AcceptAll)
    assert max(_tv(empirical[j], laws[j]) for j in range(2)) > TV_BOUND
