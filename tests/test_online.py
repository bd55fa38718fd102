"""Online adaptation arms (``calibrate.online``) on a tiny EAGLE-3 head: predict, then learn.

What must hold: no chunk is scored by weights that learnt from it; each sequence starts from the
checkpoint; LoRA starts as the head itself and changes only its own tensors; the extra bytes are
exactly the tensors'; the peak meter sees what a pass allocates.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from calibrate.drafters.eagle3 import Eagle3Adapter, load_eagle3_head
from calibrate.eval.options import EvalOptions
from calibrate.eval.run import evaluate
from calibrate.online import (LORA_MODULES, Learner, OnlineArm, OnlineOptions, OnlineSequence, PeakMemory,
                              extra_bytes, online_pass)
from sharpdraft_theory import ScaleSpec

from test_eval import ByteTokenizer
from tiny_checkpoints import tiny_target, write_tiny_eagle3

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

SPEC = ScaleSpec(law="log-linear", n_ref=64, slope=0.5, top_k=2)
M = 24  # rows per chunk in these tests
# learning hard enough that a chunk learnt from is a chunk memorised: the post-update score must move
MEMORISE = {"online-full": OnlineOptions(every=M, steps=10, lr=3e-2),
            "online-lora": OnlineOptions(every=M, steps=10, lr=1e-1, rank=4)}
MEMORISING_STEPS = 20  # steps on one chunk that make the drafter fit it


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    target = tiny_target(0)
    # the whole vocabulary as the draft vocabulary: acceptance can reach 1, so memorising shows
    folder = write_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), target, seed=1, draft_vocab_size=256)
    return Eagle3Adapter(load_eagle3_head(folder, target), target, ByteTokenizer(), path=str(folder))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = random.Random(1)
    words = ["query", "key", "mass", "attention", "drafter", "token", "the", "of", "a", "long", "context"]
    path = tmp_path_factory.mktemp("corpus") / "heldout.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(200)))
    return str(path)


def _ids(seed: int = 0, length: int = 97) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (1, length), generator=g)


def _state(head) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in head.state_dict().items()}


@pytest.mark.parametrize("method", ["online-full", "online-lora"])
def test_no_chunk_is_scored_after_the_drafter_learnt_from_it(drafter, method):
    """Chunk c's score in the run equals its score by the weights learnt from chunks 0..c-1 only;
    learning from chunk c first (steps that make it memorise the chunk) would have raised it, so the
    check has teeth."""
    options, ids = MEMORISE[method], _ids()
    arm = OnlineArm(method, method, None)
    with torch.no_grad():
        run, _, _ = online_pass(drafter, ids, arm, options)
        plain = drafter.teacher_forced(ids, [(None, None)])
    # chunk 0 is scored by the checkpoint itself: the plain drafter's rows (float32, the same causal
    # rows computed in another split of calls: 1e-5)
    torch.testing.assert_close(run.accept[0, :M], plain.accept[0, :M], atol=1e-5, rtol=0)
    assert torch.equal(run.drafted[0, :M], plain.drafted[0, :M])
    for c in (2,):  # after two chunks learnt
        seq = OnlineSequence(drafter, ids, Learner(drafter.head, method, options))
        with torch.no_grad():
            for k in range(c):
                seq.score(k * M, (k + 1) * M)
                seq.learn(k * M, (k + 1) * M, options.steps)
            seq.score(c * M, (c + 1) * M)
            before = seq.accept[c * M:(c + 1) * M].clone()
            seq.learn(c * M, (c + 1) * M, MEMORISING_STEPS)
            seq.score(c * M, (c + 1) * M)
            after = seq.accept[c * M:(c + 1) * M].clone()
        # the same operations in the same order: the same numbers
        torch.testing.assert_close(run.accept[0, c * M:(c + 1) * M], before, atol=1e-6, rtol=0)
        # this test can fail: had the run scored chunk c after learning from it, it would read `after`,
        # which lies 0.01 or more (10^4 times the 1e-6 allowed above) from `before`
        assert float(after.mean() - before.mean()) > 0.01


def test_every_sequence_starts_from_the_checkpoint(drafter, corpus):
    """The head's tensors are untouched by the online arms; a sequence's scores do not depend on the
    sequences before it (unless --online-carry, which must change them)."""
    checkpoint = _state(drafter.head)
    variants = ["none", "online-full", "online-lora"]
    online = dict(online_every=32, online_steps=2, online_lr=1e-2)  # M, G and the rate of every run here
    with torch.no_grad():
        both = evaluate(drafter, EvalOptions(drafter_path=drafter.info.path, spec=SPEC, lengths=[32, 64], corpus=corpus, sequences=2,
                                             rows_per_bucket=8, variants=variants, **online))
        second = evaluate(drafter, EvalOptions(drafter_path=drafter.info.path, spec=SPEC, lengths=[32, 64], corpus=corpus, sequences=1, skip=1,
                                               rows_per_bucket=8, variants=variants, **online))
        carried = evaluate(drafter, EvalOptions(drafter_path=drafter.info.path, spec=SPEC, lengths=[32, 64], corpus=corpus, sequences=2,
                                                rows_per_bucket=8, variants=variants, **online, online_carry=True))
    after = _state(drafter.head)
    assert all(torch.equal(checkpoint[k], after[k]) for k in checkpoint)
    for arm in ("online-full", "online-lora"):
        for b, row in enumerate(both["buckets"]):
            for metric in ("agreement", "expected_acceptance"):
                assert row[arm]["per_sequence"][metric][1] == pytest.approx(
                    second["buckets"][b][arm]["per_sequence"][metric][0], abs=1e-9)
        carried_second = [row[arm]["per_sequence"]["expected_acceptance"][1] for row in carried["buckets"]]
        fresh_second = [row[arm]["per_sequence"]["expected_acceptance"][1] for row in both["buckets"]]
        assert carried_second[0] != pytest.approx(fresh_second[0], abs=1e-6)  # carried weights score otherwise
        assert both["buckets"][1][arm]["expected_acceptance"] != both["buckets"][1]["none"]["expected_acceptance"]
    # the first chunk of every sequence is the plain drafter's: bucket n <= 32, the first 32 rows, equals none
    for arm in ("online-full", "online-lora"):
        assert both["buckets"][0][arm]["expected_acceptance"] == both["buckets"][0]["none"]["expected_acceptance"]


def test_lora_starts_as_the_head_and_changes_only_its_own_tensors(drafter):
    ids = _ids(3, 49)
    checkpoint = _state(drafter.head)
    learner = Learner(drafter.head, "online-lora", OnlineOptions(rank=4, lr=1e-2))
    adapted = sorted(learner.lora)
    assert adapted == sorted(n for n, _ in drafter.head.named_modules() if LORA_MODULES.fullmatch(n))
    assert len(adapted) == 7  # q, k, v, o, gate, up, down
    assert all(float(b.detach().abs().max()) == 0.0 for _, b in learner.lora.values())  # B = 0
    with torch.no_grad():
        features, _ = drafter.target_states(ids)
        plain = drafter.head(ids[:, 1:], features[:, :-1]).logits
        start = learner(ids[:, 1:], features[:, :-1]).logits
    assert torch.equal(plain, start)  # B = 0 adds exact zeros
    seq = OnlineSequence(drafter, ids, learner)
    before = {n: (a.detach().clone(), b.detach().clone()) for n, (a, b) in learner.lora.items()}
    with torch.no_grad():
        seq.learn(0, 24, steps=2)
        moved = learner(ids[:, 1:], features[:, :-1]).logits
    assert all(float(b.detach().abs().max()) > 0 for _, b in learner.lora.values())
    assert any(not torch.equal(a, before[n][0]) for n, (a, _) in learner.lora.items())
    assert not torch.equal(moved, plain)  # this test can fail: the adapter now changes the head's output
    after = _state(drafter.head)
    assert all(torch.equal(checkpoint[k], after[k]) for k in checkpoint)
    assert {id(p) for p in learner.optimizer.param_groups[0]["params"]} == {
        id(t) for pair in learner.lora.values() for t in pair}


@pytest.mark.parametrize("method", ["online-full", "online-lora"])
def test_extra_bytes_are_the_tensors_counted_exactly(drafter, method):
    """Weights, gradients and AdamW's two moments in float32, plus one float32 step count per tensor."""
    rank = 4
    learner = Learner(drafter.head, method, OnlineOptions(rank=rank))
    seq = OnlineSequence(drafter, _ids(4, 33), learner)
    with torch.no_grad():
        seq.learn(0, 16, steps=1)
    if method == "online-full":
        shapes = [tuple(p.shape) for n, p in drafter.head.named_parameters() if not n.startswith("embed_tokens")]
    else:
        shapes = [s for n, m in drafter.head.named_modules() if LORA_MODULES.fullmatch(n)
                  for s in ((rank, m.weight.shape[1]), (m.weight.shape[0], rank))]
    numbers = sum(int(np.prod(s)) for s in shapes)
    expected = {"weights": 4 * numbers, "gradients": 4 * numbers, "optimizer": 2 * 4 * numbers + 4 * len(shapes)}
    expected["total"] = sum(expected.values())
    assert learner.extra_bytes() == expected
    assert extra_bytes(None) == {"weights": 0, "gradients": 0, "optimizer": 0, "total": 0}


def test_eval_reports_every_arms_cost_and_the_spec_holds_no_bytes(drafter, corpus, monkeypatch, capsys):
    from test_eval import _check_fits_80_columns

    from calibrate.eval.report import print_summary

    variants = ["none", "spec", "online-full", "online-lora+spec"]
    with torch.no_grad():
        result = evaluate(drafter, EvalOptions(drafter_path=drafter.info.path, spec=SPEC, lengths=[32, 64, 128], corpus=corpus, sequences=1,
                                               rows_per_bucket=8, variants=variants, online_every=32))
    costs = result["costs"]
    assert list(costs) == variants and result["online"]["every"] == 32
    assert costs["spec"]["extra_bytes"]["total"] == 0 and costs["none"]["extra_bytes"]["total"] == 0
    assert costs["online-full"]["extra_bytes"]["total"] > costs["online-lora+spec"]["extra_bytes"]["total"] > 0
    assert all(c["seconds_per_token"] > 0 for c in costs.values())
    assert {c["pass"] for c in costs.values()} == {"shared", "own"}
    assert result["variants"]["online-lora+spec"]["law"] == "log-linear"  # it runs under the spec
    monkeypatch.setenv("COLUMNS", "80")
    print_summary(result)
    out = capsys.readouterr().out
    _check_fits_80_columns(out, variants, ["agreement", "expected_acceptance"])
    assert "ms/token" in out and "0 B" in out


def test_peak_memory_sees_what_a_pass_allocates():
    """A 256 MiB tensor made resident inside one pass counts there, and not in the next pass."""
    with PeakMemory("cpu") as big:
        block = torch.ones(64 * 2**20)  # 256 MiB of float32, touched
        del block
    with PeakMemory("cpu") as small:
        torch.ones(1024).sum()
    if big.method is None:
        pytest.skip("this system exposes no resettable peak resident set (/proc/self/clear_refs)")
    assert big.peak - small.peak > 200 * 2**20, (big.peak, small.peak)


def test_eval_refuses_online_arms_on_a_drafter_with_a_copy_pointer(drafter, corpus):
    """eval's online arms adapt and score the head alone: beside arms that mix a copy pointer in they would
    compare two drafters, so a loaded drafter with a pointer is refused in one line (the CLI refuses the folder
    before loading: tests/test_hostile.py)."""
    from calibrate.drafters.pointer import CopyPointer
    from calibrate.errors import UserError

    pointed = Eagle3Adapter(drafter.head, drafter.target, ByteTokenizer(), pointer=CopyPointer(2, 4.0, 4.0, 0.8))
    with torch.no_grad(), pytest.raises(UserError, match="copy pointer"):
        evaluate(pointed, EvalOptions(spec=SPEC, lengths=[32, 64], corpus=corpus, sequences=1,
                                      variants=["none", "online-full"]))
