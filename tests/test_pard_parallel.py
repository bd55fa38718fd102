"""PARD's parallel drafting in the one speculative loop (calibrate.drafters.parallel).

* K drafts per drafter forward; every greedy output equals target-only greedy decoding, with and
  without a spec;
* the drafts of one forward are what a full uncached pass over the text and K - 1 mask tokens gives
  (the mask tokens' cache entries are dropped, the committed tokens fed as themselves);
* a drafter that is the target itself, given an oracle mask, accepts every draft;
* the pard kind decodes in the chain loop through eval, and a config without a usable
  ``pard_token`` is refused in one line.

The sampling law of drafts drawn in one go is checked by Monte Carlo in tests/test_sampling.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from calibrate.drafters.parallel import PardParallelProposer
from calibrate.errors import UserError
from calibrate.speculative import Sampling, greedy_generate, speculative_generate

from tiny_checkpoints import tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

MASK = 250


@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


@pytest.fixture(scope="module")
def drafter_model():
    return tiny_target(5, num_layers=2)


@pytest.mark.parametrize("k", [1, 4])
def test_one_drafter_forward_per_verification(target, drafter_model, k):
    """K drafts from one forward (the output is held to the target's in tests/test_conformance.py)."""
    prompt = torch.randint(0, 250, (1, 11), generator=torch.Generator().manual_seed(k))
    drafter = PardParallelProposer(drafter_model, MASK)
    out = speculative_generate(target, drafter, prompt, 18, num_draft=k)
    assert drafter.forwards == out.steps and out.drafter == "pard"


class Recording(PardParallelProposer):
    def propose(self, k, rule):
        drafts, laws = super().propose(k, rule)
        if k > 1:  # the last steps may draft fewer than K
            self.context = self.cache.get_seq_length(), drafts
        return drafts, laws


def test_drafts_are_one_uncached_pass_over_the_text_and_masks(target, drafter_model):
    """After some steps, the next draft equals the argmax of an uncached forward over every committed
    token then K - 1 masks: the cache holds exactly the committed tokens, masks dropped."""
    prompt = torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(3))
    k = 3
    drafter = Recording(drafter_model, MASK)
    out = speculative_generate(target, drafter, prompt, 10, num_draft=k)
    assert len(drafter.context[1]) > 1
    committed = prompt[0].tolist() + out.tokens
    # the last draft read the committed text up to its pending token
    cached, drafts = drafter.context  # after a draft the cache holds the committed text up to its pending token
    assert cached > prompt.shape[1]  # a later step, not the first
    with torch.no_grad():
        full = drafter_model(torch.tensor([committed[:cached] + [MASK] * (len(drafts) - 1)])).logits[0, -len(drafts):]
    assert drafts == full.argmax(-1).tolist()


def test_only_the_k_drafted_rows_go_through_the_output_head(target, drafter_model):
    """The head is a causal LM's largest matrix: a draft of K sends K rows through it, whatever was fed."""
    rows = []
    handle = drafter_model.get_output_embeddings().register_forward_hook(lambda m, i, o: rows.append(i[0].shape[-2]))
    try:
        drafter = PardParallelProposer(drafter_model, MASK)
        prompt = torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(5))
        drafter.start(prompt, None, 7)
        drafter.commit([3, 4, 5], None)  # four unfed tokens, then two masks: six rows in, three out
        with torch.no_grad():
            drafter.draft_logits(3)
    finally:
        handle.remove()
    assert rows == [1, 3]  # the prompt's prefill keeps its last row only


def test_an_oracle_pard_drafter_accepts_whole_drafts(target):
    """The target as its own PARD drafter drafts its own greedy token at the pending position; with the
    mask rows replaced by the true continuation every draft is accepted: K + 1 per step."""
    prompt = torch.randint(0, 250, (1, 7), generator=torch.Generator().manual_seed(4))
    base = greedy_generate(target, prompt, 11)

    class Oracle(PardParallelProposer):
        def _forward(self, ids, keep):
            logits = super()._forward(ids, keep)  # the last `keep` rows: the pending token's, then the masks'
            done = self.cache.get_seq_length() - prompt.shape[1]  # generated tokens in the cache (pending incl.)
            if len(ids) > 1 and ids[-1] == MASK:
                masks = len(ids) - len(self.unfed)
                for j in range(1, masks + 1):
                    row = keep - 1 - masks + j
                    want = base.tokens[done + j] if done + j < len(base.tokens) else 0
                    logits[row] = torch.nn.functional.one_hot(torch.tensor(want), logits.shape[-1]).float()
            return logits

    out = speculative_generate(target, Oracle(target, MASK), prompt, 11, num_draft=2)
    assert out.tokens == base.tokens
    assert out.accepted == [2] * 3 + [out.accepted[-1]]  # 1 + 3 x 3 = 10, then the last token


def test_parallel_sampling_repeats_with_its_seed(target, drafter_model):
    prompt = torch.randint(0, 250, (1, 8), generator=torch.Generator().manual_seed(9))
    runs = [speculative_generate(target, PardParallelProposer(drafter_model, MASK), prompt, 12, 3,
                                 rule=Sampling(0.8, (1, 2))).tokens for _ in range(2)]
    assert runs[0] == runs[1]


# -- the command ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from test_calibrate import VOCAB, _write_causal_lm, _write_tokenizer

    root = tmp_path_factory.mktemp("pard-cli")
    tiny = tiny_target(0, vocab_size=VOCAB)
    tiny.save_pretrained(root / "target")
    _write_tokenizer(root / "target")
    _write_causal_lm(root / "pard", pard_token=VOCAB - 1, spd_type="pard")
    _write_causal_lm(root / "no-token", pard_token=None, spd_type="pard")
    (root / "corpus.txt").write_text(" ".join(["a parallel drafter reads its mask tokens at once"] * 40))
    return root


def test_eval_decodes_pard_in_the_chain_loop(folders, tmp_path):
    from typer.testing import CliRunner

    from calibrate.cli import app

    out = tmp_path / "eval.json"
    args = ["eval", "--drafter", "pard", "--drafter-path", str(folders / "pard"), "--target-path",
            str(folders / "target"), "--corpus", str(folders / "corpus.txt"), "--lengths", "32,64", "--sequences", "2",
            "--n-ref", "32", "--variants", "none,spec,window", "--device", "cpu", "--speculative", "--new-tokens", "8",
            "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    result = json.loads(out.read_text())
    r = result["speculative"]
    assert r["loop"] == "sharpdraft-chain" and r["num_draft"] == 4 and r["outputs_identical"] is True
    assert set(r["drafters"].values()) == {"pard"}
    assert r["drafting"].startswith("parallel: 4 drafts from one drafter forward")
    assert result["blocks"]["draft_length"] == 4 and len(result["blocks"]["buckets"][0]["window"]
                                                         ["expected_acceptance_by_position"]) == 4


def test_a_pard_drafter_without_its_token_is_refused(folders):
    from calibrate.drafters import load_drafter

    d = load_drafter("pard", str(folders / "no-token"), str(folders / "target"), torch.device("cpu"), torch.float32)
    with pytest.raises(UserError, match="config.json has pard_token None"):
        d.proposer(None)


def test_without_its_token_a_pard_drafter_is_measured_as_a_causal_lm(folders, tmp_path):
    """eval without --speculative still runs teacher-forced; no per-position metrics (they need the mask token)."""
    from typer.testing import CliRunner

    from calibrate.cli import app

    out = tmp_path / "eval.json"
    result = CliRunner().invoke(app, [
        "eval", "--drafter", "pard", "--drafter-path", str(folders / "no-token"), "--target-path",
        str(folders / "target"), "--corpus", str(folders / "corpus.txt"), "--lengths", "32,64", "--sequences", "1",
        "--variants", "none", "--device", "cpu", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["blocks"] is None


def test_a_missing_built_in_pard_drafter_is_named_with_what_to_do(tmp_path, monkeypatch):
    from calibrate.drafters import hf

    monkeypatch.setattr(hf, "PARD_DRAFTER_DIR", tmp_path / "pard-smollm2")
    with pytest.raises(UserError, match="the PARD drafter for SmolLM2 is missing .*scripts/train_pard.py"):
        hf.load("pard", None, None, torch.device("cpu"), torch.float32)


@pytest.mark.slow
def test_the_built_in_pard_drafter_drafts_k_tokens_a_forward_as_the_target_decodes():
    """--drafter pard with no path: the shipped drafter (SmolLM2's embedding, 4 trained layers) with its training
    length, K drafts from one forward, greedy output equal to SmolLM2's own; its copy pointer folder loads it."""
    from calibrate.drafters import hf

    drafter = hf.load("pard", None, None, torch.device("cpu"), torch.float32)
    record = json.loads((hf.PARD_DRAFTER_DIR / "training_log.json").read_text())
    assert drafter.info.path is None and drafter.default_n_ref == record["n_ref"] == 512
    assert drafter.model.config.num_hidden_layers == 4 and drafter.pard_token == 16
    prompt = torch.tensor([drafter.tokenize("def mean(values):\n    total = 0\n    for v in values:\n")])
    chain = drafter.proposer(None)
    out = speculative_generate(drafter.target, chain, prompt, 12, 4)
    assert out.tokens == greedy_generate(drafter.target, prompt, 12).tokens
    assert chain.forwards == len(out.accepted)  # one drafter forward per verification: K drafts each
    pointed = hf.load("pard", str(hf.PARD_DRAFTER_DIR.parent / "pard-smollm2-copy"), None, torch.device("cpu"),
                      torch.float32)
    assert pointed.pointer is not None and pointed.model.config.num_hidden_layers == 4
