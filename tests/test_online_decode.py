"""Online adaptation inside the one decoding loop (``calibrate.online.OnlineProposer``) on a tiny EAGLE-3 head,
a tiny DFlash model and a tiny PARD causal LM.

What must hold: greedy outputs equal target-only decoding (the target verifies; learning changes only the
drafts); every update learns from generated position ``t``'s token, the target's feature there and its law
after ``t``, the values a target pass over the finished text gives; the drafter really learns (its weights
move, and it drafts with them); the checkpoint's own tensors are never written; PARD's learning forward puts
every row where drafting puts it (the same logits).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from calibrate.drafters.dflash import DFlashAdapter, load_dflash
from calibrate.drafters.eagle3 import Eagle3Adapter, load_eagle3_head
from calibrate.drafters.hf import CausalLMAdapter
from calibrate.drafters.target import hidden_state_features
from calibrate.online import (BlockRows, ChainRows, Learner, OnlineOptions, OnlineProposer, ParallelRows,
                              online_proposer)
from calibrate.speculative import Sampling, greedy_generate, prefill, speculative_generate
from sharpdraft_theory import ScaleSpec

from tiny_checkpoints import tiny_target, write_tiny_dflash, write_tiny_eagle3

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

SPEC = ScaleSpec(law="log-linear", n_ref=16, slope=0.5, top_k=2)
EVERY = 8  # positions per update here: several updates in 60 tokens
NEW = 60
FAST = {"online-full": OnlineOptions(every=EVERY, lr=3e-2), "online-lora": OnlineOptions(every=EVERY, lr=1e-1, rank=4)}
KINDS = ("eagle3", "dflash", "pard")
ROWS = {"eagle3": ChainRows, "dflash": BlockRows, "pard": ParallelRows}
PARD_MASK = 250  # the tiny PARD model's mask token (a tiny target's vocabulary is 256)
PARD_DRAFTS = 4


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    target = tiny_target(0)
    head = load_eagle3_head(write_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), target, seed=1,
                                              draft_vocab_size=256), target)
    blocks = load_dflash(write_tiny_dflash(tmp_path_factory.mktemp("dflash"), target, seed=2, block_size=4), target)
    return {"eagle3": Eagle3Adapter(head, target, tokenizer=None), "dflash": DFlashAdapter(blocks, target, None),
            "pard": _pard(target)}


def _pard(target, pointer=None, model=None):
    """A tiny PARD drafter: a 2-layer causal LM of the target's vocabulary naming its mask token."""
    if model is None:
        model = tiny_target(5, num_layers=2)
        model.config.pard_token = PARD_MASK
    no_tokenizer = SimpleNamespace(eos_token_id=None)  # the loop here stops at the token count alone
    return CausalLMAdapter(model, no_tokenizer, kind="pard", path=None, default_n_ref=16, target=target,
                           pointer=pointer)


def _model(drafter):
    return drafter.head if drafter.kind == "eagle3" else drafter.model


def _online(drafter, method, spec, options):
    return online_proposer(drafter, method, spec, options, _drafts(drafter))


def _prompt(seed: int, length: int = 12) -> torch.Tensor:
    return torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def _drafts(drafter) -> int:
    return drafter.block_size - 1 if drafter.kind == "dflash" else PARD_DRAFTS if drafter.kind == "pard" else 4


def _start(drafter, prompt: torch.Tensor, *proposers) -> None:
    """Start each of ``proposers`` on ``prompt`` after one prefill of ``drafter``'s target, as the loop does."""
    shared = prefill(drafter.target, prompt, drafter.feature_ids)
    for proposer in proposers:
        proposer.start(prompt, shared.features, int(shared.logits.argmax()))


@pytest.mark.parametrize("spec", [None, SPEC], ids=["alone", "spec"])
@pytest.mark.parametrize("method", ["online-full", "online-lora"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_output_is_the_targets_and_the_drafter_learns(drafters, kind, method, spec):
    drafter = drafters[kind]
    checkpoint = {k: v.clone() for k, v in _model(drafter).state_dict().items()}
    for seed in range(2):
        prompt = _prompt(seed)
        shared = prefill(drafter.target, prompt, drafter.feature_ids)
        reference = greedy_generate(drafter.target, prompt, NEW, shared)
        proposer = _online(drafter, method, spec, FAST[method])
        before = [p.detach().clone() for p in proposer.learner.params]
        out = speculative_generate(drafter.target, proposer, prompt, NEW, _drafts(drafter), shared)
        assert out.tokens == reference.tokens
        assert proposer.updates >= 3 and 0 < proposer.update_seconds <= out.draft_seconds <= out.decode_seconds
        assert any(not torch.equal(a, b) for a, b in zip(before, proposer.learner.params))  # it learnt
        assert out.drafter == f"{method}+{kind}"
        held = proposer.extra_bytes()
        assert held["total"] == held["weights"] + held["gradients"] + held["optimizer"] + held["buffer"] > 0
    assert all(torch.equal(checkpoint[k], v) for k, v in _model(drafter).state_dict().items())
    # the backward reached the learner's tensors only: no gradient was formed for (or kept in) the loaded models,
    # whose parameters ask for one (as loaded)
    loaded = [*_model(drafter).parameters(), *drafter.target.parameters()]
    assert all(p.requires_grad and p.grad is None for p in loaded)


@pytest.mark.parametrize("kind", KINDS)
def test_each_update_learns_from_the_positions_a_target_pass_gives(drafters, kind, monkeypatch):
    """Every update's positions follow the last one's; their tokens are the text's, and their features and
    laws the ones one target pass over the finished text gives (float32; the verify forward scores several
    tokens at once, the full pass all of them: 1e-4 on features and probabilities). PARD reads no features: one
    empty one per position."""
    drafter = drafters[kind]
    rows = ROWS[kind]
    seen = []
    real = rows.loss

    def spy(self, learner, first, tokens, features, laws):
        seen.append((first, tokens.clone(), features.clone(), laws.clone(), self.lead))
        return real(self, learner, first, tokens, features, laws)

    monkeypatch.setattr(rows, "loss", spy)
    prompt = _prompt(5)
    out = speculative_generate(drafter.target, _online(drafter, "online-full", None, FAST["online-full"]),
                               prompt, NEW, _drafts(drafter))
    text = torch.cat((prompt, torch.tensor([out.tokens])), dim=1)
    with torch.no_grad():
        layers = len(drafter.target.get_decoder().layers)
        states = hidden_state_features(drafter.target, text, (*(drafter.feature_ids or ()), layers))
        width = drafter.target.config.hidden_size
        features, laws = states[:, :, :-width], torch.softmax(drafter.target.lm_head(states[0, :, -width:]), -1)
    if drafter.feature_ids is None:
        assert features.shape[-1] == 0
    assert len(seen) >= 3
    learnt = prompt.shape[1]
    for first, tokens, feats, taught, lead in seen:
        r = feats.shape[1]
        assert first == learnt and r >= EVERY and len(taught) >= r + lead  # the laws its rows read are there
        learnt += r
        assert torch.equal(tokens, text[0, first:first + len(tokens)])
        torch.testing.assert_close(feats, features[:, first:first + r], atol=1e-4, rtol=0)
        torch.testing.assert_close(taught, laws[first:first + len(taught)], atol=1e-4, rtol=0)  # after first ..


@pytest.mark.parametrize("kind", KINDS)
def test_the_drafter_drafts_with_the_learnt_weights(drafters, kind):
    """After a run that learnt, a proposer on the same learner started on another prompt drafts from the learnt
    weights, not the checkpoint's: its first draft logits differ from the plain proposer's."""
    drafter = drafters[kind]
    options = OnlineOptions(every=EVERY, steps=10, lr=1e-1)
    learnt = _online(drafter, "online-full", None, options)
    speculative_generate(drafter.target, learnt, _prompt(7), NEW, _drafts(drafter))
    rows = ParallelRows(drafter.proposer(None), PARD_DRAFTS) if kind == "pard" else type(learnt.rows)(
        drafter.proposer(None))
    again = OnlineProposer(rows, learnt.learner, options)
    plain = drafter.proposer(None)
    _start(drafter, _prompt(8), again, plain)

    def first_logits(proposer):
        if kind == "pard":
            return proposer.draft_logits(PARD_DRAFTS)
        return proposer.row_logits([]) if kind == "eagle3" else proposer.block_logits()

    with again.learner.applied():
        learnt_logits = first_logits(again.inner)
    assert (learnt_logits - first_logits(plain)).abs().max() > 0.1


class _Checked:
    """A proposer seen through: each proposal's laws sum to 1 and hold their drafts."""

    def __init__(self, inner):
        self.inner, self.proposals = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, k, rule):
        drafts, q = self.inner.propose(k, rule)
        np.testing.assert_allclose(q.sum(-1), 1.0, rtol=0, atol=1e-9)
        assert all(q[j, x] > 0 for j, x in enumerate(drafts))
        self.proposals += 1
        return drafts, q


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_decoding_learns_too(drafters, kind):
    """Speculative sampling with a learning drafter: the updates run in ``commit``, between proposals, and each
    proposal hands the loop laws that sum to 1 and hold their drafts."""
    drafter = drafters[kind]
    proposer = _Checked(_online(drafter, "online-lora", None, FAST["online-lora"]))
    out = speculative_generate(drafter.target, proposer, _prompt(3), NEW, _drafts(drafter), rule=Sampling(0.8, 0))
    assert len(out.tokens) == NEW and proposer.updates >= 3 and proposer.proposals == len(out.accepted)


def test_a_dflash_model_with_a_draft_vocabulary_learns_over_it(drafters, tmp_path):
    """With a draft vocabulary the teacher is the target's law over it, renormalised, and the student its logits
    there alone; the output stays the target's."""
    from calibrate.drafters.vocab import d2t_of

    from tiny_checkpoints import corrupt_checkpoint

    target = drafters["dflash"].target
    vocab = torch.arange(0, 256, 3)
    folder = corrupt_checkpoint(write_tiny_dflash(tmp_path / "plain", target, seed=2, block_size=4), tmp_path / "v",
                                lambda w: w.update(d2t=d2t_of(vocab)),
                                lambda c: c.update(draft_vocab_size=len(vocab)))
    drafter = DFlashAdapter(load_dflash(folder, target), target, None)
    proposer = _online(drafter, "online-full", None, FAST["online-full"])
    prompt = _prompt(4)
    out = speculative_generate(target, proposer, prompt, NEW, 3)
    assert out.tokens == greedy_generate(target, prompt, NEW).tokens and proposer.updates >= 3
    assert proposer.rows.columns.tolist() == vocab.tolist()


def test_lora_adapts_every_layer_of_a_dflash_model(drafters):
    learner = Learner(drafters["dflash"].model, "online-lora", OnlineOptions(rank=2))
    layers = drafters["dflash"].model.config.num_hidden_layers
    assert len(learner.lora) == 7 * layers


@pytest.mark.parametrize("kind", KINDS)
def test_a_copy_pointer_stays_around_the_learning_drafter(drafters, kind):
    """A drafter with a copy pointer (the built-in drafters' default): the online arm learns the head, and the
    pointer, which has no weights, mixes the rows the learnt weights draft. Greedy output stays the target's, the
    learner is found through the pointer, and after learning the pointer's mixed law is not the checkpoint's."""
    from calibrate.drafters.pointer import CopyPointer, unwrap, with_pointer
    from calibrate.online import learning

    plain = drafters[kind]
    pointer = CopyPointer(2, 4.0, 4.0, 0.8)
    pointed = (Eagle3Adapter(plain.head, plain.target, None, pointer=pointer) if kind == "eagle3"
               else _pard(plain.target, pointer, plain.model) if kind == "pard"
               else DFlashAdapter(plain.model, plain.target, None, pointer=pointer))
    options = OnlineOptions(every=EVERY, steps=10, lr=1e-1)
    prompt = torch.tensor([[5, 6, 7, 8, 9] * 3])  # repeats: the pointer has matches to copy
    shared = prefill(plain.target, prompt, plain.feature_ids)
    proposer = _online(pointed, "online-full", SPEC, options)
    online = learning(proposer)
    assert unwrap(proposer) == (online, pointer) and learning(plain.proposer(None)) is None
    out = speculative_generate(plain.target, proposer, prompt, NEW, _drafts(plain), shared)
    assert out.tokens == greedy_generate(plain.target, prompt, NEW, shared).tokens
    assert online.updates >= 3 and out.drafter == f"online-full+{kind}"

    frozen_pointed = with_pointer(plain.proposer(SPEC), pointer, SPEC)
    _start(plain, _prompt(9), proposer, frozen_pointed)

    def first_law(p):
        return p._row([]) if kind == "eagle3" else p.draft_logits(_drafts(plain))

    assert (first_law(proposer) - first_law(frozen_pointed)).abs().max() > 0.1


def test_lora_adapts_every_layer_of_a_pard_model_and_full_keeps_its_token_space(drafters):
    """PARD's learners adapt its decoder layers; the embedding and the LM head (the target's token space, frozen in
    PARD's training) never learn, tied or not (the tiny model's are untied)."""
    from calibrate.online import SHARED_PARD

    model = drafters["pard"].model
    assert len(Learner(model, "online-lora", OnlineOptions(rank=2), SHARED_PARD).lora) == 7 * 2
    full = Learner(model, "online-full", OnlineOptions(), SHARED_PARD).full
    assert "lm_head.weight" not in full and "model.embed_tokens.weight" not in full
    assert set(full) == {n for n, _ in model.named_parameters() if n.startswith(("model.layers.", "model.norm."))}
    learner = _online(drafters["pard"], "online-full", None, OnlineOptions()).learner
    assert set(learner.full) == set(full)


@pytest.mark.parametrize("spec", [None, SPEC], ids=["alone", "spec"])
def test_pards_learning_forward_gives_the_rows_drafting_gives(drafters, spec, monkeypatch):
    """The learning forward (``ParallelRows``: every anchor's real token and mask tokens in one call, in PARD's
    training layout, after the drafter's cache of the positions before ``first``) gives each row the logits that
    drafting from its anchor gives (one uncached forward over the text to the anchor and K - 1 masks), scale
    included; and its teachers are the laws after each row's position. Float32 over differently shaped calls:
    1e-4."""
    from calibrate.speculative import new_cache

    drafter = drafters["pard"]
    proposer = drafter.proposer(spec)
    rows = ParallelRows(proposer, PARD_DRAFTS)
    text = _prompt(11, 30)[0]
    first, r = 17, 6
    proposer.cache = new_cache()
    proposer._forward(text[:first].tolist(), 1)  # the cache of positions 0 .. first - 1
    ids, positions, mask, index = rows.layout(first, text[first:], r)
    assert index.tolist() == [p + c for c in range(PARD_DRAFTS) for p in range(r)]
    captured = {}

    def capture(logits, laws):
        captured["logits"] = logits
        return torch.zeros(())

    monkeypatch.setattr("calibrate.online.distillation_loss", capture)
    laws = torch.arange(r + PARD_DRAFTS - 1)  # stands for the laws: which one each row reads
    rows.loss(Learner(drafter.model, "online-lora", OnlineOptions(rank=2)), first, text[first:],
              torch.empty(1, r, 0), laws[:, None].float())
    assert proposer.cache.get_seq_length() == first  # the drafter's cache is read, not written to
    learnt = captured["logits"].view(PARD_DRAFTS, r, -1)
    for p in range(r):
        drafting = drafter.proposer(spec)
        drafting.cache = new_cache()
        drafting.unfed = text[:first + p + 1].tolist()
        expected = drafting.draft_logits(PARD_DRAFTS)  # (K, vocab): row c guesses x_{anchor + c + 1}
        torch.testing.assert_close(learnt[:, p], expected, atol=1e-4, rtol=0)
