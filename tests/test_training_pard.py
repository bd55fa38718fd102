"""PARD's training layout (calibrate.drafters.pard_recipe), scripts/train_pard.py and its folder's loader
(calibrate.drafters.pard_smollm2).

* every training row, in one packed forward, has the logits of the inference forward it stands for
  (the committed text up to its anchor, then its masks), with and without conditional drop;
* the layout, mask and labels by hand on a short sequence; conditional drop keeps nested anchors in the
  stated numbers, the same for the same seed;
* the cut drafter is its base's layers (first and last); a short run writes a folder of the trained
  tensors only, which the loader puts back together and which drafts in the one speculative loop with
  target-only greedy output; a stopped run resumes to the same losses as an unbroken one;
* the loader refuses a folder with a missing, extra or misshapen tensor or a base of another width;
* bad options are refused in one line before any model loads.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from calibrate.drafters.pard_recipe import IGNORE, kept_anchors, pard_rows
from calibrate.drafters.pard_smollm2 import build_pard_drafter, cut_drafter, layers_from
from calibrate.drafters.parallel import PardParallelProposer
from calibrate.errors import UserError
from calibrate.speculative import greedy_generate, speculative_generate
from calibrate.training import pard, pard_cut

from tiny_checkpoints import tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

MASK = 63
# float32 logits of the same model over the same visible keys, packed against alone: only the
# summation order differs (~1e-6 on the tiny model's O(1) logits).
ATOL_SAME32 = 1e-5



@pytest.mark.parametrize("ratio,minimum", [(1.0, 0.0), (0.7, 0.2)])
def test_each_packed_row_has_the_logits_of_the_inference_forward_it_stands_for(ratio, minimum):
    model = tiny_target(num_layers=2, vocab_size=64)
    ids = torch.randint(1, 60, (20,), generator=torch.Generator().manual_seed(0))
    rows = pard_rows(ids, 4, MASK, ratio, minimum, torch.Generator().manual_seed(1))
    assert (rows.copy > 0).sum() > 0
    with torch.no_grad():
        packed = model(input_ids=rows.input_ids[None], position_ids=rows.position_ids[None],
                       attention_mask=rows.mask()).logits[0]
        for r in range(len(rows.input_ids)):
            a, c = int(rows.anchor[r]), int(rows.copy[r])
            alone = model(input_ids=torch.cat([ids[:a + 1], torch.full((c,), MASK)])[None]).logits[0, -1]
            torch.testing.assert_close(packed[r], alone, rtol=0, atol=ATOL_SAME32)
            if int(rows.targets[r]) != IGNORE:  # the row is trained on the token its inference row guesses
                assert int(rows.targets[r]) == int(ids[a + c + 1])
    # this test can fail: a plain causal mask over the packed rows gives other logits
    with torch.no_grad():
        causal = model(input_ids=rows.input_ids[None], position_ids=rows.position_ids[None]).logits[0]
    assert (causal[rows.copy > 0] - packed[rows.copy > 0]).abs().max() > 1e-2


def test_the_layout_mask_and_labels_by_hand():
    ids = torch.tensor([10, 11, 12, 13, 14, 15])
    rows = pard_rows(ids, 3, MASK)  # no drop
    # copy 0: every position; copy 1: anchors 0..3 (row guesses x_{a+2} <= x_5); copy 2: anchors 0..2
    assert rows.copy.tolist() == [0] * 6 + [1] * 4 + [2] * 3
    assert rows.position_ids.tolist() == [0, 1, 2, 3, 4, 5] + [1, 2, 3, 4] + [2, 3, 4]
    assert rows.input_ids.tolist() == [10, 11, 12, 13, 14, 15] + [MASK] * 7
    assert rows.targets.tolist() == [11, 12, 13, 14, 15, IGNORE] + [12, 13, 14, 15] + [13, 14, 15]
    seen = rows.mask()[0, 0]
    assert seen.shape == (13, 13) and seen.dtype == torch.bool
    keys = [seen[r].nonzero().flatten().tolist() for r in range(13)]
    # copy 0: causal over the real tokens
    assert keys[:6] == [list(range(i + 1)) for i in range(6)]
    # copy 1 at position 2 (row 7, anchor 1): x_0, x_1 and itself; at position 4 (row 9, anchor 3)
    assert keys[7] == [0, 1, 7] and keys[9] == [0, 1, 2, 3, 9]
    # copy 2 at position 4 (row 12, anchor 2): x_0..x_2, copy 1 at position 3 (row 8), itself
    assert keys[12] == [0, 1, 2, 8, 12]
    assert keys[10] == [0, 6, 10]  # copy 2 at position 2 (anchor 0): x_0, copy 1 at position 1, itself


def test_conditional_drop_keeps_nested_anchors_in_the_stated_numbers():
    L, copies, ratio, minimum = 100, 6, 0.7, 0.2
    kept = kept_anchors(L, copies, ratio, minimum, torch.Generator().manual_seed(3))
    previous = set(range(L))
    for c, anchors in enumerate(kept, start=1):
        assert len(anchors) == min(L - 1 - c, int(L * max(ratio ** c, minimum)))
        assert set(anchors.tolist()) <= previous and int(anchors.max()) <= L - 2 - c
        previous = set(anchors.tolist())
    # 0.7, 0.49, 0.343, 0.2401, then the floor 0.2; int() of 100 * 0.7 ** 2 = 48.999... in floats, as PARD counts
    assert [len(a) for a in kept] == [70, 48, 34, 24, 20]
    again = kept_anchors(L, copies, ratio, minimum, torch.Generator().manual_seed(3))
    assert all(torch.equal(a, b) for a, b in zip(kept, again))
    other = kept_anchors(L, copies, ratio, minimum, torch.Generator().manual_seed(4))
    assert not all(torch.equal(a, b) for a, b in zip(kept, other))


def test_the_cut_drafter_is_its_bases_first_and_last_layers():
    base = tiny_target(num_layers=5, vocab_size=64)
    assert layers_from(3, 1, 5) == [0, 1, 4] and layers_from(3, 0, 5) == [0, 1, 2] and layers_from(2, 2, 5) == [3, 4]
    ids = torch.randint(1, 60, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for source in ([0, 1, 4], [0, 1, 2]):
            drafter = cut_drafter(base, source, MASK, 32, "base")
            assert drafter.config.num_hidden_layers == 3 and drafter.config.pard_token == MASK
            h = base.model.embed_tokens(ids)
            pos = torch.arange(12)[None]
            emb = base.model.rotary_emb(h, pos)
            causal = torch.full((12, 12), float("-inf")).triu(1)[None, None]
            for i in source:
                h = base.model.layers[i](h, attention_mask=causal, position_ids=pos, position_embeddings=emb)
                h = h[0] if isinstance(h, tuple) else h
            expected = base.lm_head(base.model.norm(h))
            torch.testing.assert_close(drafter(input_ids=ids).logits, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("cuts, message", [("4-1", "'4-1' is not F+L"), ("4+", "'4+' is not F+L"),
                                           ("a+1", "'a+1' is not F+L"), ("30+1", "do not fit a base of 30"),
                                           ("0+0", "do not fit"), ("3+1,", "'' is not F+L")])
def test_cut_agreement_refuses_a_malformed_cut(cuts, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        pard_cut.parse_cuts(cuts)
    assert pard_cut.parse_cuts("3+1,12+0") == [(3, 1), (12, 0)]


@pytest.fixture
def base(tmp_path):
    tiny_target(num_layers=3, vocab_size=64).save_pretrained(tmp_path / "base")
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(1, 60, (6, 32)))
    return tmp_path


def _argv(tmp, out, work, steps):
    return ["--base", str(tmp / "base"), "--tokens", str(tmp / "tokens.npy"), "--seq-len", "32", "--layers", "2",
            "--out", str(tmp / out), "--work", str(tmp / work), "--steps", str(steps), "--save-every", "2",
            "--mask-token", str(MASK), "--lr", "1e-3", "--batch", "2"]


def test_a_short_run_writes_a_small_folder_that_loads_drafts_exactly_and_resumes_to_the_same_losses(base):
    from transformers import AutoModelForCausalLM

    pard.main(_argv(base, "stopped", "w1", 4))
    pard.main(_argv(base, "stopped", "w1", 6))  # resumed at step 4
    pard.main(_argv(base, "straight", "w2", 6))
    logs = [json.loads((base / name / "training_log.json").read_text()) for name in ("stopped", "straight")]
    assert logs[0]["loss"] == logs[1]["loss"] and len(logs[0]["loss"]) == 6 and logs[0]["n_ref"] == 32
    assert logs[1]["layers_from"] == [0, 2] and logs[1]["k"] == 8 and "--layers 2" in logs[1]["command"]
    assert logs[1]["loss"][-1][1] < logs[1]["loss"][0][1]
    folder = base / "straight"
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "training_log.json"]
    tensors = load_file(folder / "model.safetensors")
    assert all(k.startswith("model.layers.") or k == "model.norm.weight" for k in tensors)
    assert {k.split(".")[2] for k in tensors if k.startswith("model.layers.")} == {"0", "1"}
    assert all(v.dtype == torch.float32 for v in tensors.values())
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["pard_token"] == MASK and config["max_seq_length"] == 32
    assert config["sharpdraft_embedding_from"] == str((base / "base").resolve())

    drafter = build_pard_drafter(folder)
    target = AutoModelForCausalLM.from_pretrained(base / "base", dtype=torch.float32).eval()
    assert torch.equal(drafter.get_input_embeddings().weight, target.get_input_embeddings().weight)
    assert torch.equal(drafter.model.layers[1].mlp.up_proj.weight, tensors["model.layers.1.mlp.up_proj.weight"])
    assert not torch.equal(drafter.model.layers[1].mlp.up_proj.weight, target.model.layers[2].mlp.up_proj.weight)
    prompt = torch.randint(1, 60, (1, 9), generator=torch.Generator().manual_seed(2))
    parallel = PardParallelProposer(drafter, drafter.config.pard_token)
    out = speculative_generate(target, parallel, prompt, 12, num_draft=4)
    assert out.tokens == greedy_generate(target, prompt, 12).tokens and parallel.forwards == out.steps

    # `--drafter pard --drafter-path FOLDER` puts it together the same way
    from test_calibrate import _write_tokenizer

    from calibrate.drafters import load_drafter

    _write_tokenizer(base / "base")
    loaded = load_drafter("pard", str(folder), str(base / "base"), torch.device("cpu"), torch.float32)
    assert loaded.parallel and loaded.pard_token == MASK and loaded.default_n_ref == 32
    assert all(torch.equal(a, b) for a, b in zip(loaded.model.state_dict().values(), drafter.state_dict().values()))


def test_the_distilled_loss_is_the_text_and_the_targets_law_by_hand():
    """row_loss against a float64 sum written out row by row: (1 - w) of the text's cross-entropy plus w times the
    cross-entropy against the target's top-k law at the row's position (renormalised); teacher_laws' top tokens are
    the target's own ranking at each prefix."""
    target = tiny_target(num_layers=2, vocab_size=64)
    ids = torch.randint(1, 60, (2, 16), generator=torch.Generator().manual_seed(4))
    probs, tokens = pard.teacher_laws(target, ids, 5)
    assert probs.shape == tokens.shape == (2, 16, 5)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 16), rtol=0, atol=1e-6)  # float32 softmax of 5 values
    with torch.no_grad():
        for t in (0, 7, 15):
            prefix = target(input_ids=ids[1:, :t + 1]).logits[0, -1]
            assert torch.equal(tokens[1, t], prefix.topk(5).indices)
    rows = pard_rows(ids[1], 4, MASK, 0.7, 0.2, torch.Generator().manual_seed(1))
    logits = torch.randn(len(rows.targets), 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    laws = (probs[1].double(), tokens[1])
    for w in (0.0, 0.3, 1.0):
        got = pard.row_loss(logits, rows, w, laws if w else None)
        want = 0.0
        for i in range(len(rows.targets)):
            if rows.targets[i] == IGNORE:
                continue
            log_q = torch.log_softmax(logits[i], -1)
            t = int(rows.position_ids[i])
            want += -(1 - w) * float(log_q[rows.targets[i]])
            want += -w * sum(float(probs[1, t, k]) * float(log_q[tokens[1, t, k]]) for k in range(5))
        assert abs(float(got) - want) <= 1e-9 * max(1.0, abs(want))  # float64 sums of ~100 terms of O(1)


def test_a_distilled_run_resumes_to_the_same_losses_and_differs_from_the_text_alone(base):
    pard.main(_argv(base, "a", "wa", 2) + ["--distill", "0.5", "--distill-top", "8"])
    pard.main(_argv(base, "a", "wa", 4) + ["--distill", "0.5", "--distill-top", "8"])
    pard.main(_argv(base, "b", "wb", 4) + ["--distill", "0.5", "--distill-top", "8"])
    pard.main(_argv(base, "c", "wc", 4))
    logs = [json.loads((base / name / "training_log.json").read_text()) for name in ("a", "b", "c")]
    assert logs[0]["loss"] == logs[1]["loss"] and logs[0]["loss"] != logs[2]["loss"]
    assert logs[0]["recipe"]["distill"] == "0.5" and logs[2]["recipe"]["distill"] == "0.0"
    with pytest.raises(SystemExit, match=r"other options \(distill\)"):
        pard.main(_argv(base, "a", "wa", 6) + ["--distill", "0.25", "--distill-top", "8"])


def test_the_loader_refuses_a_folder_that_does_not_fit(base):
    pard.main(_argv(base, "good", "w", 2))
    good = base / "good"
    bad = base / "bad"

    def edited(edit_weights=None, edit_config=None):
        bad.mkdir(exist_ok=True)
        tensors = load_file(good / "model.safetensors")
        config = json.loads((good / "config.json").read_text())
        if edit_weights:
            edit_weights(tensors)
        if edit_config:
            edit_config(config)
        save_file(tensors, str(bad / "model.safetensors"))
        (bad / "config.json").write_text(json.dumps(config))
        return bad

    with pytest.raises(UserError, match="lacks model.layers.1.input_layernorm.weight"):
        build_pard_drafter(edited(lambda t: t.pop("model.layers.1.input_layernorm.weight")))
    with pytest.raises(UserError, match="holds model.embed_tokens.weight"):
        build_pard_drafter(edited(lambda t: t.update({"model.embed_tokens.weight": torch.zeros(64, 64)})))
    with pytest.raises(UserError, match=r"model.norm.weight has shape \[63\], the config expects \[64\]"):
        build_pard_drafter(edited(lambda t: t.update({"model.norm.weight": torch.zeros(63)})))
    with pytest.raises(UserError, match="lacks model.layers.2"):
        build_pard_drafter(edited(edit_config=lambda c: c.update(num_hidden_layers=3)))
    with pytest.raises(UserError, match="sharpdraft_embedding_from None"):
        build_pard_drafter(edited(edit_config=lambda c: c.pop("sharpdraft_embedding_from")))
    with pytest.raises(UserError, match="pard_token 64"):
        build_pard_drafter(edited(edit_config=lambda c: c.update(pard_token=64)))
    from transformers import LlamaConfig, LlamaForCausalLM

    narrow = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(UserError, match="hidden_size 64, its base model has 32"):
        build_pard_drafter(good, base=narrow)
    (bad / "model.safetensors").unlink()
    with pytest.raises(UserError, match="no model.safetensors"):
        build_pard_drafter(bad)


@pytest.mark.parametrize("args,named", [
    (["--k", "1"], "--k 1"),
    (["--k", "31"], "--k 31"),
    (["--layers", "0"], "--layers 0"),
    (["--layers", "4"], "--layers 4: the --base model has 3"),
    (["--last", "3"], "--last 3"),
    (["--last", "-1"], "--last -1"),
    (["--ratio", "nan"], "--ratio nan"),
    (["--min-ratio", "0"], "--min-ratio 0.0"),
    (["--ratio", "1.5"], "--ratio 1.5"),
    (["--lr", "nan"], "--lr nan"),
    (["--lr", "-1"], "--lr -1.0"),
    (["--seq-len", "0"], "--seq-len 0"),
    (["--batch", "0"], "--batch 0"),
    (["--steps", "0"], "--steps 0"),
    (["--mask-token", "-1"], "--mask-token -1"),
    (["--mask-token", "64"], "--mask-token 64: the --base model has 64 tokens"),
    (["--tokens", "missing.npy"], "--tokens missing.npy"),
    (["--device", "tpu"], "--device tpu"),
    (["--distill", "-0.1"], "--distill -0.1"),
    (["--distill", "1.5"], "--distill 1.5"),
    (["--distill", "nan"], "--distill nan"),
    (["--distill-top", "0"], "--distill-top 0"),
    (["--distill-top", "65"], "--distill-top 65: the --base model has 64 tokens"),
])
def test_bad_options_are_refused_in_one_line(base, args, named):
    with pytest.raises(SystemExit) as stop:
        pard.main(_argv(base, "out", "w", 2) + args)
    assert named in str(stop.value) and "\n" not in str(stop.value)
    assert not (base / "out").exists()


@pytest.mark.parametrize("args,named", [
    (["--layers", "31"], "--layers 31: SmolLM2 has 30 decoder layers"),
    (["--mask-token", "49152"], "--mask-token 49152"),
    (["--sources", "pydoc:heldout"], "--sources pydoc:heldout"),
    (["--sources", "stdlib,recall:stdlib:all"], "--sources recall:stdlib:all"),
    (["--sources", "pydoc,"], "--sources ''"),
    (["--sources", "nowhere.txt"], "--sources nowhere.txt"),
])
def test_smollm2_options_are_refused_before_smollm2_loads(tmp_path, monkeypatch, args, named):
    import calibrate.smollm2

    monkeypatch.setattr(calibrate.smollm2, "load_smollm2", lambda *a, **k: pytest.fail("SmolLM2 loaded"))
    with pytest.raises(SystemExit) as stop:
        pard.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "w")] + args)
    assert named in str(stop.value) and "\n" not in str(stop.value)


def test_outputs_that_are_inputs_or_files_are_refused(base):
    (base / "f").write_text("x")
    for option, value, fragment in (("--out", "f", "--out .*f: is a file"), ("--out", "base", "is the --base folder"),
                                    ("--work", "f", "--work .*f: is a file"), ("--work", "out", "is --out")):
        argv = _argv(base, "out", "w", 2)
        argv[argv.index(option) + 1] = str(base / value)
        with pytest.raises(SystemExit, match=fragment):
            pard.parse(argv)
    assert (base / "f").read_text() == "x"
    pard.main(_argv(base, "out", "w3", 2))
    with pytest.raises(SystemExit, match=r"other options \(lr\)"):
        pard.main(_argv(base, "out", "w3", 2) + ["--lr", "2e-3"])


def test_tokens_of_the_wrong_shape_or_holding_the_mask_are_refused(base):
    np.save(base / "flat.npy", np.arange(1, 33))
    argv = _argv(base, "out", "w", 2)
    argv[argv.index("--tokens") + 1] = str(base / "flat.npy")
    with pytest.raises(SystemExit, match=r"shape \(32,\); expected \(N, --seq-len 32\)"):
        pard.main(argv)
    with pytest.raises(SystemExit, match="--mask-token 5: present in the training text"):
        pard.main(_argv(base, "out", "w", 2) + ["--mask-token", "5"])
    assert not (base / "out").exists()
