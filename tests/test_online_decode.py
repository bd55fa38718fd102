"""Online adaptation inside the one decoding loop (``calibrate.online.OnlineProposer``) on a tiny EAGLE-3 head.

What must hold: greedy outputs equal target-only decoding (the target verifies; learning changes only the
drafts); every update learns generated head row ``t`` (feature at ``t``, token ``t + 1``) from the target's
law after position ``t + 1``, the rows a teacher-forced pass over the finished text gives; the drafter
really learns (its weights move, and drafts with them); the head's own tensors are never written.
"""

from __future__ import annotations

import pytest
import torch

from calibrate.drafters.eagle3 import Eagle3Adapter, Eagle3Proposer, load_eagle3_head
from calibrate.online import Learner, OnlineOptions, OnlineProposer, online_proposer
from calibrate.speculative import greedy_generate, prefill, speculative_generate
from sharpdraft_theory import ScaleSpec

from tiny_checkpoints import tiny_target, write_tiny_eagle3

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

SPEC = ScaleSpec(law="log-linear", n_ref=16, slope=0.5, top_k=2)
EVERY = 8  # rows per update here: several updates in 60 tokens
NEW = 60
FAST = {"online-full": OnlineOptions(every=EVERY, lr=3e-2), "online-lora": OnlineOptions(every=EVERY, lr=1e-1, rank=4)}


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    target = tiny_target(0)
    head = load_eagle3_head(write_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), target, seed=1,
                                              draft_vocab_size=256), target)
    return Eagle3Adapter(head, target, tokenizer=None)


def _prompt(seed: int, length: int = 12) -> torch.Tensor:
    return torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def _online(drafter, method: str, spec=None) -> OnlineProposer:
    return online_proposer(drafter, method, spec, FAST[method])


@pytest.mark.parametrize("spec", [None, SPEC], ids=["alone", "spec"])
@pytest.mark.parametrize("method", ["online-full", "online-lora"])
def test_greedy_output_is_the_targets_and_the_drafter_learns(drafter, method, spec):
    head = {k: v.clone() for k, v in drafter.head.state_dict().items()}
    for seed in range(2):
        prompt = _prompt(seed)
        shared = prefill(drafter.target, prompt, drafter.feature_ids)
        reference = greedy_generate(drafter.target, prompt, NEW, shared)
        proposer = _online(drafter, method, spec)
        before = [p.detach().clone() for p in proposer.learner.params]
        out = speculative_generate(drafter.target, proposer, prompt, NEW, 4, shared)
        assert out.tokens == reference.tokens
        assert proposer.updates >= 3 and 0 < proposer.update_seconds <= out.draft_seconds <= out.decode_seconds
        assert any(not torch.equal(a, b) for a, b in zip(before, proposer.learner.params))  # it learnt
        assert out.drafter == f"{method}+eagle3"
        held = proposer.extra_bytes()
        assert held["total"] == held["weights"] + held["gradients"] + held["optimizer"] + held["buffer"] > 0
    assert all(torch.equal(head[k], v) for k, v in drafter.head.state_dict().items())  # the checkpoint untouched


def test_each_update_learns_the_rows_a_teacher_forced_pass_gives(drafter, monkeypatch):
    """Row t of an update pairs the target's feature at t, token t + 1 and the target's law after t + 1:
    compared with one target pass over the finished text (float32; the verify forward scores several
    tokens at once, a full pass all of them: 1e-4 on features and probabilities)."""
    seen = []
    real = OnlineProposer._learn

    def spy(self, row, ids, features, teacher):
        seen.append((row, ids.clone(), features.clone(), teacher.clone()))
        real(self, row, ids, features, teacher)

    monkeypatch.setattr(OnlineProposer, "_learn", spy)
    prompt = _prompt(5)
    proposer = _online(drafter, "online-full")
    out = speculative_generate(drafter.target, proposer, prompt, NEW, 4)
    text = torch.cat((prompt, torch.tensor([out.tokens])), dim=1)
    with torch.no_grad():
        features, final = drafter.target_states(text)  # final: positions 1 .. T-1
        columns = drafter.head.draft_to_target(torch.arange(drafter.head.config.draft_vocab_size))
        laws = torch.softmax(drafter.target.get_output_embeddings()(final)[:, columns], dim=-1)
    assert len(seen) >= 3
    learnt = prompt.shape[1]
    for row, ids, feats, teacher in seen:
        assert row == learnt  # the chunks follow each other from the first generated row
        rows = ids.shape[1]
        learnt += rows
        assert rows >= EVERY
        assert torch.equal(ids[0], text[0, row + 1:row + rows + 1])
        torch.testing.assert_close(feats, features[:, row:row + rows], atol=1e-4, rtol=0)
        torch.testing.assert_close(teacher, laws[row:row + rows], atol=1e-4, rtol=0)  # law after row + 1


def test_the_chain_drafts_with_the_learnt_weights(drafter):
    """After a run that learnt, the chain started on another prompt drafts from the learnt head's logits
    (the learner's own forward, exactly), not the checkpoint's."""
    options = OnlineOptions(every=EVERY, steps=10, lr=1e-1)
    learner = Learner(drafter.head, "online-full", options)
    speculative_generate(drafter.target, OnlineProposer(Eagle3Proposer(drafter.head, drafter.feature_ids), learner,
                                                        options), _prompt(7), NEW, 4)
    prompt = _prompt(8)
    shared = prefill(drafter.target, prompt, drafter.feature_ids)
    pending = int(shared.logits.argmax())
    learnt = OnlineProposer(Eagle3Proposer(drafter.head, drafter.feature_ids), learner, options)
    plain = Eagle3Proposer(drafter.head, drafter.feature_ids)
    for proposer in (learnt, plain):
        proposer.start(prompt, shared.features, pending)
    ids = torch.cat((prompt[:, 1:], torch.tensor([[pending]])), dim=1)
    with torch.no_grad():
        own = learner(ids, shared.features).logits[0, -1]
    assert torch.equal(learnt.chain.logits, own)
    assert (learnt.chain.logits - plain.logits).abs().max() > 0.1  # the learnt head is another head
