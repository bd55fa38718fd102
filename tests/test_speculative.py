"""Greedy speculative decoding returns the target's greedy output, token for token."""

from __future__ import annotations

import pytest
import torch

from calibrate.drafters.eagle3 import Eagle3Adapter, load_eagle3_head
from calibrate.drafters.causal import CausalLMProposer
from calibrate.speculative import NoProposer, greedy_generate, speculative_generate
from sharpdraft_theory import ScaleSpec

from tiny_checkpoints import tiny_target, write_tiny_eagle3

SPEC = ScaleSpec(law="log-linear", n_ref=8, slope=0.5, top_k=2)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)


@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    return load_eagle3_head(write_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), target, seed=1), target)


@pytest.fixture(scope="module")
def eagle3(head, target):
    return Eagle3Adapter(head, target, tokenizer=None)


def prompts(vocab: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (1, n), generator=g) for n in (2, 7, 30)]


def test_self_drafting_accepts_everything(target):
    """The target drafting for itself: every draft is accepted, K + 1 tokens per target forward."""
    prompt = prompts(target.config.vocab_size)[1]
    out = speculative_generate(target, CausalLMProposer(target), prompt, 16, 4)
    assert out.tokens == greedy_generate(target, prompt, 16).tokens
    assert out.accepted == [4, 4, 4]  # 1 token from the prefill, then 5 per target forward
    assert out.acceptance_length == 5.0


def test_a_stop_token_ends_the_output_where_target_only_decoding_ends_it(target, eagle3):
    """``stop``: every proposer's output is target-only decoding's, cut after the first ``stop`` token."""
    prompt = prompts(target.config.vocab_size)[2]
    full = greedy_generate(target, prompt, 24).tokens
    stop = full[9]  # a token the target writes: the output must end at its first occurrence
    cut = full[:full.index(stop) + 1]
    for proposer in (NoProposer(), CausalLMProposer(target), eagle3.proposer(None)):
        out = speculative_generate(target, proposer, prompt, 24, 4, stop=stop)
        assert out.tokens == cut, proposer.name
        assert out.decode_tokens == len(cut) - 1 and sum(a + 1 for a in out.accepted) >= len(cut) - 1
    first = speculative_generate(target, NoProposer(), prompt, 24, stop=full[0])
    assert first.tokens == full[:1] and first.accepted == []  # the prefill's own token ends it


@torch.no_grad()
def test_a_minimum_length_bars_the_stop_token_until_it_is_reached(target, eagle3):
    """``min_new_tokens``: the stop token cannot be written before that many tokens; every proposer's output
    is the greedy output of the barred law, computed here without a cache, one full forward a token."""
    prompt = prompts(target.config.vocab_size)[2]
    full = greedy_generate(target, prompt, 24).tokens
    stop, least = full[2], 12  # a token the target writes early: barred through output token 11

    ids, reference = prompt, []
    while len(reference) < 24:
        logits = target(input_ids=ids).logits[0, -1].double()
        if len(reference) < least:
            logits[stop] = float("-inf")
        reference.append(int(logits.argmax()))
        if reference[-1] == stop:
            break
        ids = torch.cat([ids, torch.tensor([[reference[-1]]])], dim=1)
    assert stop not in reference[:least] and reference != full[:len(reference)]  # the bar changed the output
    for proposer in (NoProposer(), CausalLMProposer(target), eagle3.proposer(None)):
        out = speculative_generate(target, proposer, prompt, 24, 4, stop=stop, min_new_tokens=least)
        assert out.tokens == reference, proposer.name
    unbarred = speculative_generate(target, NoProposer(), prompt, 24, stop=stop, min_new_tokens=0)
    assert unbarred.tokens == full[:3]  # 0: the output ends at the first stop token, as without the option


def test_draft_seconds_count_the_drafters_calls_and_nothing_else(target):
    """``draft_seconds``: the time in the drafter's draft and commit, a part of the decode time."""
    import time

    class Slow:  # a proposer of nothing, 20 ms slower in each draft and each commit
        def __init__(self, inner):
            self.inner = inner
            self.name, self.feature_ids = inner.name, inner.feature_ids

        def start(self, *args):
            time.sleep(0.3)  # before decoding: not drafting time
            return self.inner.start(*args)

        def propose(self, k, rule):
            time.sleep(0.02)
            return self.inner.propose(k, rule)

        def commit(self, tokens, features):
            time.sleep(0.02)
            return self.inner.commit(tokens, features)

    prompt = prompts(target.config.vocab_size)[1]
    out = speculative_generate(target, Slow(NoProposer()), prompt, 16, 4)
    assert out.steps == 15
    assert 0.04 * out.steps <= out.draft_seconds < out.decode_seconds  # two sleeps a round
    # the start's 0.3 s is not drafting time (the empty proposer's own calls take microseconds)
    assert out.draft_seconds < 0.04 * out.steps + 0.25


def test_eagle3_head_cache_matches_full_pass(target, head, eagle3):
    """After decoding, the head's cached rows equal a fresh teacher-forced pass over the output."""
    prompt = prompts(target.config.vocab_size)[2]
    drafter = eagle3.proposer(None)
    out = speculative_generate(target, drafter, prompt, 12, 3)
    full = torch.cat((prompt, torch.tensor([out.tokens[:-1]])), dim=1)
    from calibrate.drafters.eagle3 import target_features

    feats = target_features(target, full)
    ref = head(full[:, 1:], feats[:, :-1], return_logits=False).past_key_values[0]
    key = drafter.past[0][:, :, :drafter.rows - 1]
    torch.testing.assert_close(key, ref[:, :, :key.shape[2]], rtol=1e-4, atol=1e-4)


def test_bad_num_draft(target):
    with pytest.raises(ValueError, match="num_draft"):
        speculative_generate(target, CausalLMProposer(target), prompts(256)[0], 4, 0)


@pytest.mark.slow
def test_smollm2_demo_head_equals_greedy():
    """The real target and the built-in EAGLE-3 drafter (the demo head with its copy pointer): identical output,
    and some drafts accepted."""
    from calibrate.drafters import load_drafter

    d = load_drafter("eagle3", None, None, torch.device("cpu"), torch.float32)  # the drafter ships: no skip
    assert d.pointer is not None
    prompt = torch.tensor([d.tokenize("The for statement is used to iterate over the elements of a sequence")])
    reference = greedy_generate(d.target, prompt, 12).tokens
    out = speculative_generate(d.target, d.proposer(None), prompt, 12, 4)
    assert out.tokens == reference
    assert out.acceptance_length > 1.0


def test_a_shared_prefill_changes_nothing(target, eagle3):
    """Runs from one shared prefill (as eval runs every variant) equal runs with their own prefill,
    and none of them alters the shared cache."""
    from calibrate.speculative import prefill

    for prompt in prompts(target.config.vocab_size):
        shared = prefill(target, prompt, eagle3.feature_ids)
        length = shared.cache.get_seq_length()
        assert greedy_generate(target, prompt, 11, shared).tokens == greedy_generate(target, prompt, 11).tokens
        for spec in (None, SPEC):
            alone = speculative_generate(target, eagle3.proposer(spec), prompt, 11, 3)
            again = speculative_generate(target, eagle3.proposer(spec), prompt, 11, 3, shared)
            assert (again.tokens, again.accepted) == (alone.tokens, alone.accepted)
        assert shared.cache.get_seq_length() == length
        hf = speculative_generate(target, CausalLMProposer(tiny_target(3)), prompt, 11, 3, shared)
        assert hf.tokens == greedy_generate(target, prompt, 11).tokens


def test_a_shared_prefill_must_hold_the_drafters_features(target, eagle3):
    from calibrate.speculative import prefill

    prompt = prompts(target.config.vocab_size)[1]
    with pytest.raises(ValueError, match="hidden states"):
        speculative_generate(target, eagle3.proposer(None), prompt, 5, 2, prefill(target, prompt, (0, 1)))
