"""A DFlash head with a draft vocabulary (``draft_vocab_size`` + ``d2t``): only those rows of the target's
output head run, every other token is ``-inf``; drafting stays exact; the loader and
``scripts/dflash_draft_vocab.py`` refuse what does not fit in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from calibrate.drafters.blocks import DFlashBlockProposer, block_teacher_forced
from calibrate.drafters.dflash import DFlashAdapter, load_dflash
from calibrate.drafters.target import hidden_state_features
from calibrate.drafters.vocab import d2t_of
from calibrate.errors import UserError
from calibrate.speculative import Sampling, greedy_generate, softmax, speculative_generate
from calibrate.training import draft_vocab

from tiny_checkpoints import corrupt_checkpoint, tiny_target, write_tiny_dflash

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

BS = 4
VOCAB = torch.arange(0, 256, 3)  # 86 of the tiny target's 256 ids


def with_vocab(config, ids=VOCAB):
    config["draft_vocab_size"] = len(ids)


@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


@pytest.fixture(scope="module")
def plain(target, tmp_path_factory):
    return write_tiny_dflash(tmp_path_factory.mktemp("dflash"), target, seed=2, block_size=BS)


@pytest.fixture(scope="module")
def folder(plain, tmp_path_factory):
    return corrupt_checkpoint(plain, tmp_path_factory.mktemp("dflash-vocab"), lambda w: w.update(d2t=d2t_of(VOCAB)),
                              with_vocab)


@pytest.fixture(scope="module")
def models(plain, folder, target):
    return load_dflash(plain, target), load_dflash(folder, target)


def test_logits_are_the_heads_rows_on_the_vocabulary_and_minus_infinity_elsewhere(models, target):
    whole, restricted = models
    hidden = torch.randn(3, 5, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    full, part = whole.compute_logits(hidden, target), restricted.compute_logits(hidden, target)
    off = torch.ones(256, dtype=torch.bool)
    off[VOCAB] = False
    assert torch.isneginf(part[..., off]).all()
    # the same rows of the same matrix: equal up to float32 rounding of a matmul over fewer rows
    torch.testing.assert_close(part[..., VOCAB], full[..., VOCAB], rtol=1e-5, atol=1e-6)
    assert restricted.config.draft_vocab_size == len(VOCAB) and whole.draft_ids() is None
    notes = DFlashAdapter(restricted, target, tokenizer=None).notes
    assert any("drafts from 86 of the target's 256 tokens" in n for n in notes)


def test_draft_logits_are_the_finite_columns_of_the_logits(models, target):
    """``draft_logits`` (what online adaptation learns through) is ``compute_logits`` at the draft ids, exactly."""
    for model in models:
        hidden = torch.randn(3, 5, target.config.hidden_size, generator=torch.Generator().manual_seed(2))
        ids = model.draft_ids()
        full = model.compute_logits(hidden, target)
        assert torch.equal(model.draft_logits(hidden, target), full if ids is None else full[..., ids])


def test_the_vocabularys_rows_are_cut_once(models, target):
    """Cutting 4,096 rows out of SmolLM2's head costs about what the drafting forward does: once per head."""
    _, restricted = models
    hidden = torch.randn(2, target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    restricted.compute_logits(hidden, target)
    first = restricted._draft_rows
    restricted.compute_logits(hidden, target)
    assert restricted._draft_rows is first


def test_a_head_loaded_in_inference_mode_drafts(folder, target):
    """eval loads and runs drafters under torch.inference_mode, whose tensors keep no version counter."""
    with torch.inference_mode():
        model = load_dflash(folder, target)
        logits = model.compute_logits(torch.ones(2, target.config.hidden_size), target)
    assert torch.isfinite(logits[:, VOCAB]).all()


def test_greedy_block_drafting_stays_exact_and_drafts_in_the_vocabulary(models, target):
    _, restricted = models
    prompt = torch.randint(0, 255, (1, 12), generator=torch.Generator().manual_seed(7))
    base = greedy_generate(target, prompt, 20)
    drafter = DFlashBlockProposer(restricted, target)
    out = speculative_generate(target, drafter, prompt, 20, num_draft=BS - 1)
    assert out.tokens == base.tokens and drafter.forwards == out.steps
    feats = hidden_state_features(target, prompt, restricted.config.hidden_state_ids)
    drafter.start(prompt, feats, 5)
    drafts, q = drafter.propose(BS - 1, Sampling(0.7, 3))
    assert all(int(x) in VOCAB.tolist() for x in drafts)
    # each row's law is softmax over the vocabulary's logits, zero elsewhere: what sampling's rule needs
    logits = drafter.block_logits(BS - 1)
    for j in range(BS - 1):
        assert q[j, np.setdiff1d(np.arange(256), VOCAB.numpy())].max() == 0
        np.testing.assert_allclose(q[j, VOCAB.numpy()], softmax(logits[j, VOCAB].double().numpy(), 0.7),
                                   rtol=0, atol=1e-12)


def test_teacher_forced_drafts_stay_in_the_vocabulary(models, target):
    whole, restricted = models
    text = torch.randint(0, 255, (1, 30), generator=torch.Generator().manual_seed(3))
    ids = restricted.config.hidden_state_ids
    part = block_teacher_forced(restricted, target, text, ids, [(None, None)])
    full = block_teacher_forced(whole, target, text, ids, [(None, None)])
    assert torch.isin(part.drafted, VOCAB).all()
    inside = torch.isin(full.drafted, VOCAB)  # where the whole vocabulary's argmax is in it, nothing changes
    assert inside.any() and torch.equal(part.drafted[inside], full.drafted[inside])
    assert (part.accept <= 1 + 1e-6).all() and (part.accept >= 0).all()


@pytest.mark.parametrize("weights, config, named", [
    (lambda w: w.update(d2t=d2t_of(VOCAB)), None, "d2t"),  # a map with no draft_vocab_size: an unknown weight
    (None, with_vocab, "d2t"),  # draft_vocab_size with no map: a missing weight
    (lambda w: w.update(d2t=d2t_of(VOCAB) + 200), with_vocab, "d2t"),  # ids past the vocabulary
    (lambda w: w.update(d2t=-torch.arange(len(VOCAB))), with_vocab, "twice"),  # every row target id 0
    (None, lambda c: c.update(draft_vocab_size=0), "draft_vocab_size 0"),
    (None, lambda c: c.update(draft_vocab_size=257), "draft_vocab_size 257"),
], ids=["map-only", "size-only", "outside", "repeated", "zero", "too-many"])
def test_a_bad_draft_vocabulary_is_refused_in_one_line(plain, target, tmp_path, weights, config, named):
    bad = corrupt_checkpoint(plain, tmp_path / "bad", weights, config)
    with pytest.raises(UserError, match=named) as info:
        load_dflash(bad, target)
    assert "\n" not in str(info.value)


# -- scripts/dflash_draft_vocab.py ----------------------------------------------------------------

@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Two shards whose tokens favour ids 10 .. 19 (target_features.py's layout; only tokens are read)."""
    folder = tmp_path_factory.mktemp("shards")
    for i in range(2):
        tokens = torch.cat((torch.arange(10, 20).repeat(5), torch.arange(100, 110)))
        torch.save({"tokens": tokens}, folder / f"seq-{i:05d}.pt")
    (folder / "manifest.json").write_text(json.dumps({"sequences": 2, "seq_len": 60}))
    return folder


def test_the_script_writes_a_head_that_drafts_from_the_most_frequent_tokens(plain, shards, target, tmp_path, capsys):
    out = tmp_path / "head"
    draft_vocab.main([str(plain), "--features", str(shards), "--size", "10", "--out", str(out)])
    model = load_dflash(out, target)
    assert model.draft_ids().tolist() == list(range(10, 20))
    record = json.loads((out / "training_log.json").read_text())["draft_vocab"]
    assert record["size"] == 10 and record["coverage"] == pytest.approx(100 / 120, abs=1e-4)
    before = load_dflash(plain, target).state_dict()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items() if k != "d2t")
    assert "cover 0.8333" in capsys.readouterr().out


@pytest.mark.parametrize("args, named", [
    (["--size", "0"], "--size 0"),
    (["--size", "-3"], "--size -3"),
    (["--size", "256"], "--size 256"),
    (["--size", "10" + "0" * 20], "--size 1000"),
    (["--size", "10", "--features", "nowhere"], "--features nowhere"),
], ids=["size-zero", "size-negative", "size-whole", "size-huge", "no-features"])
def test_the_scripts_bad_values_are_refused_before_any_work(plain, shards, tmp_path, args, named):
    argv = [str(plain), "--features", str(shards), "--out", str(tmp_path / "h"), *args]
    with pytest.raises(SystemExit, match=named):
        draft_vocab.main(argv)
    assert not (tmp_path / "h").exists()


def test_the_script_overwrites_nothing_and_refuses_a_head_with_a_vocabulary(plain, folder, shards, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    with pytest.raises(SystemExit, match="exists"):
        draft_vocab.main([str(plain), "--features", str(shards), "--size", "10", "--out", str(tmp_path / "taken")])
    assert (tmp_path / "taken" / "x").read_text() == "x"
    with pytest.raises(SystemExit, match="already drafts from 86 tokens"):
        draft_vocab.main([str(folder), "--features", str(shards), "--size", "10", "--out", str(tmp_path / "h")])
    with pytest.raises(SystemExit, match="exists"):  # --out the head itself
        draft_vocab.main([str(plain), "--features", str(shards), "--size", "10", "--out", str(plain)])
    (shards.parent / "wide").mkdir()
    torch.save({"tokens": torch.tensor([3, 9999])}, shards.parent / "wide" / "seq-00000.pt")
    (shards.parent / "wide" / "manifest.json").write_text(json.dumps({"sequences": 1, "seq_len": 2}))
    with pytest.raises(SystemExit, match="not ids of the head's vocabulary of 256"):
        draft_vocab.main([str(plain), "--features", str(shards.parent / "wide"), "--size", "1",
                          "--out", str(tmp_path / "h")])
    assert not (tmp_path / "h").exists()
    with pytest.raises(SystemExit, match="not a DFlash head folder"):
        draft_vocab.main([str(shards), "--features", str(shards), "--size", "10", "--out", str(tmp_path / "h")])


def test_eval_runs_a_head_with_a_draft_vocabulary_end_to_end(tmp_path):
    """The CLI loads and runs drafters in inference mode: teacher-forced rows, blocks and speculative decoding."""
    from typer.testing import CliRunner

    from calibrate.cli import app
    from test_calibrate import VOCAB as TOKENS, _write_tokenizer

    tiny = tiny_target(0, vocab_size=TOKENS)
    tiny.save_pretrained(tmp_path / "target")
    _write_tokenizer(tmp_path / "target")
    plain = write_tiny_dflash(tmp_path / "plain", tiny, seed=2, block_size=BS)
    ids = torch.arange(0, TOKENS, 2)
    head = corrupt_checkpoint(plain, tmp_path / "head", lambda w: w.update(d2t=d2t_of(ids)),
                              lambda c: c.update(draft_vocab_size=len(ids)))
    (tmp_path / "corpus.txt").write_text(" ".join(["a block drafts every token of the next few at once"] * 40))
    out = tmp_path / "eval.json"
    result = CliRunner().invoke(app, [
        "eval", "--drafter", "dflash", "--drafter-path", str(head), "--target-path", str(tmp_path / "target"),
        "--corpus", str(tmp_path / "corpus.txt"), "--lengths", "16,64", "--sequences", "2", "--n-ref", "16",
        "--variants", "none,spec", "--device", "cpu", "--speculative", "--new-tokens", "8", "--out", str(out)])
    assert result.exit_code == 0, result.output
    r = json.loads(out.read_text())
    assert r["speculative"]["outputs_identical"] is True
    assert len(r["blocks"]["buckets"][1]["none"]["agreement_by_position"]) == BS - 1
