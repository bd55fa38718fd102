"""``scripts/chain_agreement.py`` (``calibrate.training.chain``): teacher-forced agreement at every step
of an EAGLE-3 head's chain.

A tiny random target and head (``tiny_checkpoints``) stand in for SmolLM2 and its heads; the chain
itself is ``Eagle3Head.unrolled``, tested equal to the chain drafter in ``test_training_ttt.py``. Here:
step 1 equals the head's own teacher-forced forward (on a head with the options released heads carry
too), a head paired with itself differs by exactly 0, and bad arguments are refused in one line.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from calibrate.training import chain

from tiny_checkpoints import tiny_target, write_tiny_eagle3

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)


@pytest.fixture
def tiny(tmp_path):
    from test_calibrate import _write_tokenizer

    target = tiny_target(0)
    target.save_pretrained(tmp_path / "target")
    _write_tokenizer(tmp_path / "target")
    write_tiny_eagle3(tmp_path / "a", target, seed=1)
    write_tiny_eagle3(tmp_path / "b", target, seed=2)
    (tmp_path / "corpus.txt").write_text(" ".join(["the query sees more keys as the context grows"] * 60))
    return tmp_path


def test_step_one_is_the_heads_teacher_forced_agreement(tiny):
    from calibrate.drafters import load_drafter
    drafter = load_drafter("eagle3", str(tiny / "a"), str(tiny / "target"), torch.device("cpu"), torch.float32)
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    steps = chain.chain_agreement(drafter, ids, 3)
    with torch.no_grad():
        features, final = drafter.target_states(ids)
        logits = drafter.head(ids[:, 1:], features[:, :-1]).logits[0]  # rows 0 .. T - 2
        drafted = drafter.head.draft_to_target(logits.argmax(-1))
        greedy = drafter.target.get_output_embeddings()(final).argmax(-1)
    rows = 40 - 3
    assert steps.shape == (3,) and np.all((steps >= 0) & (steps <= 1))
    assert steps[0] == pytest.approx((drafted[:rows] == greedy[:rows]).float().mean().item(), abs=1e-12)


def test_a_head_paired_with_itself_differs_by_nothing_and_another_by_something(tiny, capsys):
    chain.main([str(tiny / "a"), str(tiny / "a"), str(tiny / "b"), "--target-path", str(tiny / "target"),
                 "--corpus", str(tiny / "corpus.txt"), "--sequences", "3", "--length", "48", "--steps", "2"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {tiny}")]
    assert len(rows) == 3
    assert rows[1].count("(+0.000 [+0.000, +0.000])") == 2
    assert rows[0].split("|")[2:4] == [" " + c.split(" (")[0].strip() + " " for c in rows[1].split("|")[2:4]]
    assert rows[2] != rows[1]  # another head, other drafts


@pytest.mark.parametrize("extra, named", [
    (["--steps", "0"], "--steps 0: give an integer >= 1"),
    (["--sequences", "0"], "--sequences 0: give an integer >= 1"),
    (["--length", "5", "--steps", "4"], "--length 5: give at least --steps \\+ 2"),
    (["--sequences", "500"], "sequences of 48 tokens, not 500"),
])
def test_bad_arguments_are_refused_in_one_line(tiny, extra, named):
    with pytest.raises(SystemExit, match=named):
        chain.main([str(tiny / "a"), "--target-path", str(tiny / "target"), "--corpus", str(tiny / "corpus.txt"),
                     "--length", "48", *extra])
    with pytest.raises(SystemExit, match="no config.json there"):
        chain.main([str(tiny / "nothing"), "--target-path", str(tiny / "target")])


def test_first_step_logits_are_the_drafters_own_on_a_head_with_every_option():
    """qk_norm, norm_before_residual and RoPE on 8 of 16 dimensions: the chain's step 0 is the head's forward.

    float64 throughout; tolerance 1e-10: both sides sum the same few hundred O(1) products in another
    order, so they differ by rounding (~1e-14), far below a real difference. The chain's former copy of
    the head's math (RoPE over all 16 dimensions, no q/k norm, the un-normed residual) was off by up to
    1.04 on these logits (max |logit| 3.6) and drafted another token on 27% of the rows."""
    from calibrate.drafters.eagle3 import Eagle3Adapter
    from tiny_checkpoints import tiny_eagle3_head

    target = tiny_target(0).double()
    head = tiny_eagle3_head(target, seed=1, qk_norm=True, norm_before_residual=True, rotary_dim=8).double()
    assert head.config.head_dim == 16
    drafter = Eagle3Adapter(head, target, None)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    steps = 3
    with torch.no_grad():
        features, _ = drafter.target_states(ids)
        rows = 40 - steps
        chain = head.unrolled(features[:, :rows], ids[:, 1:rows + steps], torch.arange(rows)[None], steps, chunk=64)
        own = head(ids[:, 1:], features[:, :-1]).logits[0, :rows]
    torch.testing.assert_close(chain[0][0], own, rtol=0, atol=1e-10)
