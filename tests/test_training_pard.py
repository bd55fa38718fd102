"""PARD's training layout (calibrate.drafters.pard_recipe) and scripts/train_pard.py.

* every training row, in one packed forward, has the logits of the inference forward it stands for
  (the committed text up to its anchor, then its masks), with and without conditional drop;
* the layout by hand on a short sequence; conditional drop keeps nested anchors in the stated numbers;
* a short run writes a drafter folder that drafts in the one speculative loop with target-only greedy
  output, and a stopped run resumes to the same losses as an unbroken one;
* bad options are refused in one line before any model loads.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from calibrate.drafters.pard_recipe import IGNORE, kept_anchors, pard_rows
from calibrate.drafters.parallel import PardParallelDrafter
from calibrate.speculative import greedy_generate, speculative_generate

from tiny_checkpoints import load_script, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

MASK = 63
# float32 logits of the same model over the same visible keys, packed against alone: only the
# summation order differs (~1e-6 on the tiny model's O(1) logits).
ATOL_SAME32 = 1e-5


def _script():
    return load_script("train_pard")


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
    # this test can fail: a plain causal mask over the packed rows gives other logits
    with torch.no_grad():
        causal = model(input_ids=rows.input_ids[None], position_ids=rows.position_ids[None]).logits[0]
    assert (causal[rows.copy > 0] - packed[rows.copy > 0]).abs().max() > 1e-2


def test_the_layout_by_hand():
    ids = torch.tensor([10, 11, 12, 13, 14, 15])
    rows = pard_rows(ids, 3, MASK)  # no drop
    # copy 0: every position; copy 1: anchors 0..3 (row guesses x_{a+2} <= x_5); copy 2: anchors 0..2
    assert rows.copy.tolist() == [0] * 6 + [1] * 4 + [2] * 3
    assert rows.position_ids.tolist() == [0, 1, 2, 3, 4, 5] + [1, 2, 3, 4] + [2, 3, 4]
    assert rows.input_ids.tolist() == [10, 11, 12, 13, 14, 15] + [MASK] * 7
    assert rows.targets.tolist() == [11, 12, 13, 14, 15, IGNORE] + [12, 13, 14, 15] + [13, 14, 15]
    seen = rows.mask()[0, 0]
    # copy 2 at position 4 (anchor 2): x_0..x_2, copy 1 at position 3, itself; nothing else
    row = 6 + 4 + 2
    assert seen[row].nonzero().flatten().tolist() == [0, 1, 2, 6 + 2, row]


def test_conditional_drop_keeps_nested_anchors_in_the_stated_numbers():
    L, copies, ratio, minimum = 100, 6, 0.7, 0.2
    kept = kept_anchors(L, copies, ratio, minimum, torch.Generator().manual_seed(3))
    previous = set(range(L))
    for c, anchors in enumerate(kept, start=1):
        assert len(anchors) == min(L - 1 - c, int(L * max(ratio ** c, minimum)))
        assert set(anchors.tolist()) <= previous and int(anchors.max()) <= L - 2 - c
        previous = set(anchors.tolist())
    again = kept_anchors(L, copies, ratio, minimum, torch.Generator().manual_seed(3))
    assert all(torch.equal(a, b) for a, b in zip(kept, again))


@pytest.fixture
def base(tmp_path):
    tiny_target(num_layers=3, vocab_size=64).save_pretrained(tmp_path / "base")
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(1, 60, (6, 32)))
    return tmp_path


def _argv(tmp, out, work, steps):
    return ["--base", str(tmp / "base"), "--tokens", str(tmp / "tokens.npy"), "--seq-len", "32", "--layers", "2",
            "--out", str(tmp / out), "--work", str(tmp / work), "--steps", str(steps), "--save-every", "2",
            "--mask-token", str(MASK), "--lr", "1e-3", "--batch", "2"]


def test_a_short_run_writes_a_drafter_that_drafts_exactly_and_resumes_to_the_same_losses(base):
    from transformers import AutoModelForCausalLM

    script = _script()
    script.main(_argv(base, "stopped", "w1", 4))
    script.main(_argv(base, "stopped", "w1", 6))  # resumed at step 4
    script.main(_argv(base, "straight", "w2", 6))
    logs = [json.loads((base / name / "training_log.json").read_text()) for name in ("stopped", "straight")]
    assert logs[0]["loss"] == logs[1]["loss"] and len(logs[0]["loss"]) == 6 and logs[0]["n_ref"] == 32
    drafter = AutoModelForCausalLM.from_pretrained(base / "straight", dtype=torch.float32).eval()
    assert drafter.config.num_hidden_layers == 2 and drafter.config.pard_token == MASK
    assert drafter.config.max_seq_length == 32
    target = AutoModelForCausalLM.from_pretrained(base / "base", dtype=torch.float32).eval()
    assert torch.equal(drafter.get_input_embeddings().weight, target.get_input_embeddings().weight.bfloat16().float())
    prompt = torch.randint(1, 60, (1, 9), generator=torch.Generator().manual_seed(2))
    parallel = PardParallelDrafter(drafter, MASK)
    out = speculative_generate(target, parallel, prompt, 12, num_draft=4)
    assert out.tokens == greedy_generate(target, prompt, 12).tokens and parallel.forwards == out.steps


@pytest.mark.parametrize("args,named", [
    (["--copies", "1"], "--copies 1"),
    (["--copies", "31"], "--copies 31"),
    (["--layers", "0"], "--layers 0"),
    (["--ratio", "nan"], "--ratio nan"),
    (["--min-ratio", "0"], "--min-ratio 0.0"),
    (["--ratio", "1.5"], "--ratio 1.5"),
    (["--lr", "-1"], "--lr -1.0"),
    (["--seq-len", "0"], "--seq-len 0"),
    (["--batch", "0"], "--batch 0"),
    (["--mask-token", "-1"], "--mask-token -1"),
    (["--tokens", "missing.npy"], "--tokens missing.npy"),
])
def test_bad_options_are_refused_in_one_line(base, args, named):
    with pytest.raises(SystemExit) as stop:
        _script().parse(_argv(base, "out", "w", 2) + args)
    assert named in str(stop.value) and "\n" not in str(stop.value)


def test_outputs_that_are_inputs_or_files_are_refused(base):
    script = _script()
    (base / "f").write_text("x")
    for out, fragment in (("f", "is a file"), ("base", "is the --base folder")):
        argv = _argv(base, "out", "w", 2)
        argv[argv.index("--out") + 1] = str(base / out)
        with pytest.raises(SystemExit, match=fragment):
            script.parse(argv)
    assert (base / "f").read_text() == "x"
    with pytest.raises(SystemExit, match="layers 9: the base model has 3"):
        script.main(_argv(base, "out", "w", 2) + ["--layers", "9"])
    script.main(_argv(base, "out", "w3", 2))
    with pytest.raises(SystemExit, match="other options"):
        script.main(_argv(base, "out", "w3", 2) + ["--lr", "2e-3"])


def test_tokens_of_the_wrong_shape_or_holding_the_mask_are_refused(base):
    script = _script()
    np.save(base / "flat.npy", np.arange(1, 33))
    argv = _argv(base, "out", "w", 2)
    argv[argv.index("--tokens") + 1] = str(base / "flat.npy")
    with pytest.raises(SystemExit, match=r"shape \(32,\); expected \(N, --seq-len 32\)"):
        script.main(argv)
    with pytest.raises(SystemExit, match="--mask-token 5: .* present in the training text"):
        script.main(_argv(base, "out", "w", 2) + ["--mask-token", "5"])
    assert not (base / "out").exists()
