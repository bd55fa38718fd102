"""Prompt lookup (calibrate.lookup): transformers' drafts, token for token; exact in the chain loop.

* :class:`PromptLookup` proposes what transformers' ``PromptLookupCandidateGenerator`` proposes, on
  random sequences over small alphabets (where matches are many), for every n-gram size and draft
  length, with and without an end-of-sequence token; ``min_ngram`` above 1 against the rule
  written out here;
* the teacher-forced drafts (:func:`next_token_drafts`) are the first token of a proposal after
  every prefix;
* in the chain loop, greedy: ``lookup`` and ``lookup+head`` return target-only greedy decoding's
  output, token for token (the sampling law: tests/test_sampling.py).
"""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import calibrate.lookup as lookup_module
from calibrate.drafters.eagle3 import Eagle3Adapter, load_eagle3_head
from calibrate.lookup import LookupProposer, LookupSettings, PromptLookup, next_token_drafts
from calibrate.speculative import greedy_generate, speculative_generate

from tiny_checkpoints import tiny_target, write_tiny_eagle3

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

EOS = 0
sequences = st.integers(2, 5).flatmap(lambda v: st.lists(st.integers(0, v - 1), min_size=1, max_size=40))


def test_doctests():
    assert doctest.testmod(lookup_module).failed == 0


def _transformers(ids: list[int], k: int, max_ngram: int, eos: int | None) -> list[int]:
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    generator = PromptLookupCandidateGenerator(eos_token_id=None if eos is None else torch.tensor([eos]),
                                               num_output_tokens=k, max_matching_ngram_size=max_ngram,
                                               max_length=len(ids) + 100)
    candidates, _ = generator.get_candidates(torch.tensor([ids]))
    return candidates[0, len(ids):].tolist()


@settings(derandomize=True, max_examples=150, deadline=None)
@given(ids=sequences, k=st.integers(1, 5), max_ngram=st.integers(1, 4), eos=st.sampled_from([None, EOS]))
def test_proposals_are_transformers_prompt_lookup(ids, k, max_ngram, eos):
    index = PromptLookup(LookupSettings(max_ngram=max_ngram, eos_token_id=eos))
    index.extend(ids)
    assert index.propose(k) == _transformers(ids, k, max_ngram, eos)


def _rule(ids: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The rule, written out: longest suffix first, its leftmost earlier place with a token after it."""
    for m in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        for i in range(len(ids) - m):
            if ids[i:i + m] == ids[len(ids) - m:]:
                return ids[i + m:i + m + k]
    return []


@settings(derandomize=True, max_examples=150, deadline=None)
@given(ids=sequences, k=st.integers(1, 5), ngrams=st.tuples(st.integers(1, 4), st.integers(1, 4)))
def test_a_shortest_ngram_above_one(ids, k, ngrams):
    min_ngram, max_ngram = sorted(ngrams)
    index = PromptLookup(LookupSettings(max_ngram=max_ngram, min_ngram=min_ngram))
    index.extend(ids)
    assert index.propose(k) == _rule(ids, k, max_ngram, min_ngram)


@settings(derandomize=True, max_examples=60, deadline=None)
@given(ids=sequences, max_ngram=st.integers(1, 3))
def test_teacher_forced_drafts_are_the_first_proposed_token(ids, max_ngram):
    got = next_token_drafts(ids, LookupSettings(max_ngram=max_ngram, eos_token_id=EOS))
    assert got.shape == (len(ids) + 1,)
    for j in range(len(ids) + 1):
        want = _transformers(ids[:j], 1, max_ngram, EOS) if j >= 1 else []
        assert got[j] == (want[0] if want else -1), j


def test_the_leftmost_place_wins_and_an_end_of_sequence_stops_the_search():
    index = PromptLookup(LookupSettings(max_ngram=1, eos_token_id=EOS))
    index.extend([3, 4, 3, 5, 3])
    assert index.propose(2) == [4, 3]  # the first 3 (not the latest, which drafts 5)
    index = PromptLookup(LookupSettings(max_ngram=2, eos_token_id=EOS))
    index.extend([3, 4, EOS, 9, 3, 4])
    assert index.propose(3) == []  # "3 4" is followed by the end of sequence: no draft, no shorter match tried


@pytest.mark.parametrize("fields, match", [
    ({"max_ngram": 0}, "max_ngram"), ({"max_ngram": 65}, "max_ngram"), ({"min_ngram": 0}, "min_ngram"),
    ({"max_ngram": 2, "min_ngram": 3}, "min_ngram"), ({"max_ngram": 2.0}, "max_ngram"),
    ({"min_ngram": True}, "min_ngram"),
])
def test_bad_settings_name_the_field(fields, match):
    with pytest.raises(ValueError, match=match):
        LookupSettings(**fields)


# -- the chain loop, greedy ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


@pytest.fixture(scope="module")
def eagle3(target, tmp_path_factory):
    head = load_eagle3_head(write_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), target, seed=1), target)
    return Eagle3Adapter(head, target, tokenizer=None)


def _prompts(vocab: int):
    g = torch.Generator().manual_seed(0)
    passage = torch.randint(1, vocab, (1, 12), generator=g)
    repeated = torch.cat((passage, torch.randint(1, vocab, (1, 5), generator=g), passage[:, :6]), dim=1)
    return [torch.randint(0, vocab, (1, 2), generator=g), torch.randint(0, vocab, (1, 9), generator=g), repeated]


def test_no_match_verifies_the_pending_token_alone(target):
    """Without a match lookup drafts nothing, and the loop verifies the pending token alone."""
    from calibrate.speculative import GREEDY

    vocab = target.config.vocab_size
    drafter = LookupProposer(vocab, LookupSettings(max_ngram=1))
    drafter.start(torch.tensor([[1, 2, 3]]), None, 7)
    assert drafter.propose(4, GREEDY) == ([], None)
    # only 4-grams match: none fits in the first steps' context, so they draft nothing
    prompt = torch.tensor([[1, 2, 3]])
    out = speculative_generate(target, LookupProposer(vocab, LookupSettings(max_ngram=4, min_ngram=4)), prompt, 6, 3)
    assert out.tokens == greedy_generate(target, prompt, 6).tokens
    assert out.accepted[0] == 0 and out.steps == 5


def test_point_mass_laws_for_sampling():
    from calibrate.speculative import Sampling

    drafter = LookupProposer(6, LookupSettings())
    drafter.start(torch.tensor([[1, 2, 3, 1]]), None, 2)
    drafts, laws = drafter.propose(3, Sampling(1.0, 0))
    assert drafts == [3, 1, 2] and laws.shape == (3, 6)
    np.testing.assert_array_equal(laws, np.eye(6)[drafts])
