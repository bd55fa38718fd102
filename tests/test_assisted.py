"""``hf`` drafters: transformers' own assisted generation as a cross-check of the one loop, and the
``eval`` command decoding them in that loop.

``assisted_generation.transformers_generate`` runs ``target.generate(..., assistant_model=...)`` and
reads acceptance from the outside; these tests hold it to target-only greedy decoding and to an
independent count of what each target forward must commit, worked out from the drafter's own greedy
choices by plain full forwards, and hold the toolkit's causal-LM proposer in the one loop to the same
output.
"""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.drafters.hf import CausalLMAdapter
from calibrate.errors import UserError
from calibrate.speculative import greedy_generate, speculative_generate
from sharpdraft_runtime import disable, enable, is_enabled
from sharpdraft_theory import ScaleSpec

from assisted_generation import assistant, transformers_generate
from test_calibrate import VOCAB, _write_tokenizer
from test_eval import ByteTokenizer
from tiny_checkpoints import tiny_target

N_REF = 8
SLOPE = ScaleSpec(law="log-linear", n_ref=N_REF, slope=0.5, top_k=2)
WINDOW = ScaleSpec(law="constant", n_ref=None, slope=0.0, top_k=2, window=N_REF, sinks=2)
SPECS = [None, SLOPE, WINDOW]
IDS = ["none", "slope", "window"]
NEW_TOKENS, NUM_DRAFT = 16, 4

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)


@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


@pytest.fixture(scope="module")
def drafters(target):
    """A smaller drafter (2 layers, other weights) and an exact copy of the target (its own module)."""
    return {name: CausalLMAdapter(model, ByteTokenizer(), kind="hf", path=name, default_n_ref=N_REF, target=target)
            for name, model in (("small", tiny_target(3, num_layers=2)), ("copy", tiny_target(0)))}


def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (1, n), generator=g) for n in (2, 7, 30, 60)]


def assisted(target, drafter, spec, prompt, num_draft=NUM_DRAFT):
    with assistant(drafter, spec) as model:
        return transformers_generate(target, prompt, NEW_TOKENS, model, num_draft)


def expected_commits(model, spec, prompt, tokens, num_draft) -> list[int]:
    """Tokens each target forward of greedy assisted generation commits, worked out without it.

    Per round the drafter proposes ``min(K, N - done - 1)`` greedy tokens after the committed text
    (transformers' cap, so that the bonus token fits); since ``tokens`` is the target's greedy
    output, the target accepts drafts while they equal ``tokens`` and adds its own next token. The
    drafter runs uncached full forwards with ``spec`` enabled here, not through ``drafter.assistant``.
    """
    if spec is not None:
        enable(model, spec)
    try:
        commits, done = [], 0
        while done < len(tokens):
            context = prompt[0].tolist() + tokens[:done]
            accepted = 0
            while accepted < min(num_draft, len(tokens) - done - 1):
                logits = model(input_ids=torch.tensor([context + tokens[done:done + accepted]])).logits
                if int(logits[0, -1].argmax()) != tokens[done + accepted]:
                    break
                accepted += 1
            commits.append(accepted + 1)
            done += accepted + 1
        return commits
    finally:
        if spec is not None:
            disable(model)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("name", ["small", "copy"])
def test_output_is_target_greedy(target, drafters, name, spec):
    for prompt in prompts():
        reference = target.generate(prompt, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None)
        reference = reference[0, prompt.shape[1]:].tolist()
        assert greedy_generate(target, prompt, NEW_TOKENS).tokens == reference  # the one loop's reference too
        alone = transformers_generate(target, prompt, NEW_TOKENS)
        assert alone.tokens == reference and alone.steps == NEW_TOKENS and set(alone.accepted) == {0}
        assert assisted(target, drafters[name], spec, prompt).tokens == reference
        proposer = drafters[name].proposer(spec)  # the toolkit's own loop: the same output
        assert speculative_generate(target, proposer, prompt, NEW_TOKENS, NUM_DRAFT).tokens == reference


def test_self_drafting_accepts_every_draft(target, drafters):
    """The target's copy drafts exactly its greedy tokens: K + 1 per forward, but the last (drafts are capped
    at N - generated - 1, so the 16th token comes alone)."""
    out = assisted(target, drafters["copy"], None, prompts()[2])
    assert [a + 1 for a in out.accepted] == [5, 5, 5, 1]
    assert out.steps == 4 and out.acceptance_length == 4.0
    assert out.decode_tokens == NEW_TOKENS - 5  # the first forward (the prefill) committed 5


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("name", ["small", "copy"])
def test_acceptance_equals_an_independent_count(target, drafters, name, spec):
    drafter = drafters[name]
    for prompt in prompts():
        out = assisted(target, drafter, spec, prompt)
        commits = [a + 1 for a in out.accepted]
        assert commits == expected_commits(drafter.model, spec, prompt, out.tokens, NUM_DRAFT)
        assert out.acceptance_length == NEW_TOKENS / out.steps


@pytest.mark.parametrize("spec", [SLOPE, WINDOW], ids=IDS[1:])
def test_the_spec_changes_the_drafts(target, drafters, spec):
    """Not vacuous: past n_ref the scaled or windowed copy drafts other tokens than the target, so it
    needs more forwards than the 4 of the unscaled copy, and the small drafter's greedy tokens change
    (this test can fail)."""
    prompt = prompts()[3]
    out = assisted(target, drafters["copy"], spec, prompt)
    assert out.steps > 4
    ids = torch.cat((prompt, torch.tensor([out.tokens])), dim=1)
    small = drafters["small"].model
    plain = small(input_ids=ids).logits[0].argmax(-1)
    enable(small, spec)
    try:
        scaled = small(input_ids=ids).logits[0].argmax(-1)
    finally:
        disable(small)
    assert torch.equal(scaled[:N_REF], plain[:N_REF]) and not torch.equal(scaled, plain)


def test_spec_is_on_the_assistant_while_it_drafts(target, drafters):
    """The assistant's forwards inside generate run with the spec bound; before and after, without it;
    its generation config is left as it was."""
    drafter = drafters["copy"]
    seen = []
    handle = drafter.model.register_forward_pre_hook(lambda module, args: seen.append(is_enabled(module)))
    config = drafter.model.generation_config
    try:
        assisted(target, drafter, SLOPE, prompts()[2])
    finally:
        handle.remove()
    assert seen and all(seen) and not is_enabled(drafter.model)
    assert drafter.model.generation_config is config and config.num_assistant_tokens is None


def test_chain_length_is_fixed(target, drafters):
    """K = num_draft every round whatever the assistant's generation config says: a heuristic schedule
    from 2 and a confidence threshold (which stops chains of this random model early) are overridden
    for the call, and left in place after it."""
    model = drafters["copy"].model
    own = model.generation_config
    model.generation_config = copy.deepcopy(own)
    model.generation_config.update(num_assistant_tokens=2, num_assistant_tokens_schedule="heuristic",
                                   assistant_confidence_threshold=0.9)
    try:
        out = assisted(target, drafters["copy"], None, prompts()[2])
        assert [a + 1 for a in out.accepted] == [5, 5, 5, 1]
        assert (model.generation_config.num_assistant_tokens, model.generation_config.num_assistant_tokens_schedule,
                model.generation_config.assistant_confidence_threshold) == (2, "heuristic", 0.9)
    finally:
        model.generation_config = own


def test_assistant_must_differ_from_the_target(target):
    same = CausalLMAdapter(target, ByteTokenizer(), kind="hf", path=None, default_n_ref=N_REF, target=target)
    with pytest.raises(UserError, match="a drafter different from the target"):
        same.proposer(None)
    with pytest.raises(ValueError, match="a module other than the target"):
        transformers_generate(target, prompts()[0], 4, target)
    with pytest.raises(ValueError, match="num_draft"):
        transformers_generate(target, prompts()[0], 4, tiny_target(0), 0)



def copy_drafter_eval(tmp_path) -> list[str]:
    """Tiny checkpoints for ``sharpdraft eval --drafter hf --speculative``: the target, the drafter (the target's copy
    with n_ref 64, so unscaled it accepts every draft) and a corpus; the eval arguments that name them."""
    target = tiny_target(0, vocab_size=VOCAB)
    target.save_pretrained(tmp_path / "target")
    _write_tokenizer(tmp_path / "target")
    copy = tiny_target(0, vocab_size=VOCAB)
    copy.config.max_position_embeddings = 64  # the hf drafter's n_ref
    copy.save_pretrained(tmp_path / "drafter")
    rng = random.Random(0)
    words = ["query", "key", "mass", "attention", "drafter", "token", "the", "of", "a", "long", "context"]
    (tmp_path / "corpus.txt").write_text(" ".join(rng.choice(words) for _ in range(200)))
    return ["eval", "--drafter", "hf", "--drafter-path", str(tmp_path / "drafter"), "--target-path",
            str(tmp_path / "target"), "--corpus", str(tmp_path / "corpus.txt"), "--lengths", "32,64,128",
            "--sequences", "2", "--speculative", "--new-tokens", "8", "--num-draft", "3", "--device", "cpu",
            "--threads", "1"]

def test_eval_cli_decodes_hf_in_the_one_loop(tmp_path):
    """``sharpdraft eval --drafter hf --speculative`` on tiny checkpoints, lookup included: the drafter is the
    target's copy with n_ref 64, so the unscaled variant accepts every draft (the prefill's token, then 7 in
    forwards of at most 4)."""
    result = CliRunner().invoke(app, [
        *copy_drafter_eval(tmp_path), "--variants", "none,spec,qwen-logn,window,sinks,lookup,lookup+head", "--json",
        "--out", str(tmp_path / "eval.json")])
    assert result.exit_code == 0, result.output
    r = json.loads((tmp_path / "eval.json").read_text())
    heads = ("none", "spec", "qwen-logn", "window", "sinks")
    assert r["speculative"] == {"loop": "sharpdraft-chain", "new_tokens": 8, "num_draft": 3,
                                "drafting": "chain: one draft per drafter forward", "verification": "greedy",
                                "temperature": None, "seed": None, "outputs_identical": True,
                                "drafters": {**{v: "hf" for v in heads}, "lookup": "lookup", "lookup+head": "lookup+hf"}}
    assert r["drafter"]["n_ref"] == 64 and list(r["variants"]) == [*heads, "lookup", "lookup+head"]
    for row in r["buckets"]:
        assert row["none"]["acceptance_length"] == 4.0  # K + 1: this test can fail
        for variant in r["variants"]:
            assert 1.0 <= row[variant]["acceptance_length"] <= 4.0 and row[variant]["speedup"] > 0
            assert row[variant]["draft_ms_per_round"] > 0 and 0 < row[variant]["draft_share"] < 1
            if variant != "none":
                assert len(row[variant]["delta_vs_none"]["acceptance_length"]) == 3
        if row["n"] <= 64:  # alpha = 1 and no window binds: every variant of the head is the plain copy
            assert all(row[v]["acceptance_length"] == 4.0 for v in heads)
    assert r["buckets"][-1]["window"]["acceptance_length"] < 4.0  # 64 of ~120 keys: other drafts
