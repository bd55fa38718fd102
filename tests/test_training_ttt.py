"""The training-time test (``Eagle3Head.unrolled``, which ``scripts/train_demo_eagle3.py`` trains by) computes
what the chain drafter runs.

Drafting step ``s`` after a true context ending at base row ``r`` is computed for every row at once
in training (one attention over the step-0 keys plus the chain's own keys). Here each (r, s) is
recomputed the way ``Eagle3Proposer`` runs it at inference: the head over rows ``0 .. r`` with
true features, then ``s`` single-row calls that feed the head's own output hidden state back with
a cache. In float64 the two agree to rounding (tolerance 1e-10: sums of a few hundred products of
O(1) numbers, far above float64 rounding, far below any real difference).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from calibrate.drafters.eagle3 import Eagle3Config, Eagle3Head
from calibrate.training import eagle3 as train, features

ROOT = Path(__file__).resolve().parent.parent


def _head(seed: int, **options) -> Eagle3Head:
    torch.manual_seed(seed)
    config = Eagle3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                          vocab_size=50, draft_vocab_size=20, rope_theta=1000.0, **options)
    head = Eagle3Head(config).double()
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        head.d2t.copy_(torch.arange(20) * 2 - torch.arange(20))
    return head.eval()


# the options a released head may carry (the demo heads use none): each changes the function the head computes
OPTIONS = {"plain": {}, "qk-norm-residual-rotary": dict(qk_norm=True, norm_before_residual=True, rotary_dim=4),
           "fc-norm-output": dict(fc_norm=True, final_norm=False, norm_output=True),
           "window": dict(norm_before_fc=True, sliding_window=3)}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("chunk", [3, 64])
@pytest.mark.parametrize("context", [0, 5])
def test_unrolled_steps_equal_the_proposer(chunk, context, options):
    """Every (base row, step), with and without context rows in front of the window, with every option."""
    head = _head(seed=1, **options)
    T, ttt, start = 10 + context, 4, 7
    gen = torch.Generator().manual_seed(2)
    features = torch.randn(1, T, 3 * 32, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, 50, (1, T + ttt - 1), generator=gen)
    pos = start + torch.arange(T)[None]
    with torch.no_grad():
        unrolled = list(head.unrolled(features, tokens, pos, ttt, chunk, context))
        assert unrolled[0].shape[1] == T - context
        for r in range(context, T):
            out = head(tokens[:, :r + 1], features[:, :r + 1], position_ids=pos[:, :r + 1])
            torch.testing.assert_close(unrolled[0][0, r - context], out.logits[0, -1], rtol=0, atol=1e-10)
            past, hidden = out.past_key_values, out.hidden_states[:, -1:]
            for s in range(1, ttt):
                out = head(tokens[:, r + s:r + s + 1], hidden, position_ids=pos[:, r:r + 1] + s, past_key_values=past)
                torch.testing.assert_close(unrolled[s][0, r - context], out.logits[0, -1], rtol=0, atol=1e-10)
                past, hidden = out.past_key_values, out.hidden_states[:, -1:]


@pytest.mark.parametrize("context", [0, 5])
def test_the_unrolled_chain_makes_every_tensor_on_the_heads_device(context):
    """On PyTorch's meta device (shapes, no data), which refuses a CPU operand as CUDA does: a mask made on
    the CPU stopped the first GPU run of this script, and a CPU-only suite could not see it."""
    config = Eagle3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                          vocab_size=50, draft_vocab_size=20, rope_theta=1000.0)
    head = Eagle3Head(config).to("meta")
    T, ttt = 10 + context, 4
    features = torch.empty(2, T, 3 * 32, device="meta")
    tokens = torch.empty(2, T + ttt - 1, dtype=torch.long, device="meta")
    pos = torch.arange(T, device="meta")[None].expand(2, T)
    steps = list(head.unrolled(features, tokens, pos, ttt, 3, context))
    assert [tuple(s.shape) for s in steps] == [(2, T - context, 20)] * ttt


def test_a_later_step_differs_from_step_zero():
    """Not vacuous: step 1 reads the head's own output, so its logits differ from step 0's."""
    head = _head(seed=3)
    gen = torch.Generator().manual_seed(4)
    features = torch.randn(2, 6, 96, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, 50, (2, 7), generator=gen)
    with torch.no_grad():
        step0, step1 = head.unrolled(features, tokens, torch.arange(6).expand(2, 6), 2, 4)
    assert (step0 - step1).abs().max() > 1e-3


def test_windows_with_context_see_their_sequence_from_its_start():
    data = {"tokens": torch.arange(40).view(2, 20), "features": torch.randn(2, 20, 6), "final": torch.randn(2, 20, 2)}
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        features, tokens, final, pos, context = train.sample_windows(gen, data, 1, 6, 3, context=100)
        assert pos[0, 0] == 0 and pos.shape[1] == context + 6  # every earlier row is context
        assert tokens[0, 0] % 20 == 1 and tokens.shape[1] == context + 6 + 2
        assert int(pos[0, -1]) + 3 <= 19  # the last step's teacher exists


@pytest.mark.parametrize("case", ["missing", "same-as-out", "other-span"])
def test_init_refuses_a_folder_it_cannot_continue(tmp_path, case):
    """``--init`` is checked before features or the target load: one line, exit 1, nothing written."""
    import subprocess

    head = tmp_path / "head"
    if case != "missing":
        head.mkdir()
        (head / "model.safetensors").write_bytes(b"")
        (head / "training_log.json").write_text("{}")
        (head / "config.json").write_text('{"max_position_embeddings": 8192, "draft_vocab_size": 4096, '
                                          '"intermediate_size": 1536}')
    out = head if case == "same-as-out" else tmp_path / "out"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "train_demo_eagle3.py"), "--init", str(head),
                          "--out", str(out), "--work", str(tmp_path / "work")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "--init" in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "work").exists() and not (tmp_path / "out").exists()


def test_steps_behind_a_record():
    steps_of = train._steps_of
    assert steps_of({"command": "python x.py --span 256 --steps 360 --lr 0.002"}) == 360
    assert steps_of({"command": "python x.py --steps 720", "steps_total": 1080}) == 1080
    # a head grown by scripts/induction_head.py keeps its source head's record under "head"
    grown = {"command": "python scripts/induction_head.py --epochs 12", "head": {"steps_total": 1080, "train_seconds": 9.5}}
    assert steps_of(grown) == 1080 and train._seconds_of(grown) == 9.5
    assert steps_of({"command": "python scripts/induction_head.py"}) == 0 and train._seconds_of({}) == 0.0


@pytest.mark.parametrize("chunk", [3, 64])
def test_drawn_far_keys_are_the_proposers_whole_context(chunk):
    """With ``--far``, row ``r`` at step ``s`` is the chain drafter over exactly the drawn keys and the
    window's rows ``<= r``, each at its true position (positions with gaps: the head's RoPE reads them)."""
    head = _head(seed=5)
    gen = torch.Generator().manual_seed(6)
    data = {"tokens": torch.randint(0, 50, (2, 60), generator=gen),
            "features": torch.randn(2, 60, 96, generator=gen, dtype=torch.float64),
            "final": torch.randn(2, 60, 32, generator=gen, dtype=torch.float64)}
    ttt, rows, far = 3, 5, 4
    features, tokens, _, pos, context = train.sample_windows(gen, data, 2, rows, ttt, 0, far=far, reach=30)
    assert context == far
    assert bool((pos[:, 1:far] > pos[:, :far - 1]).all())  # drawn keys sorted, distinct
    assert bool((pos[:, far - 1] < pos[:, far]).all())  # all before the window
    assert bool((pos[:, -1] - pos[:, 0] <= 30).all())  # within reach of the window's last row
    assert bool((pos[:, far + 1:] - pos[:, far:-1] == 1).all())  # the window is contiguous
    assert pos[0, :far].diff().max() > 1  # not vacuous: the drawn keys leave gaps
    features, tokens = features.double(), tokens
    with torch.no_grad():
        unrolled = list(head.unrolled(features, tokens, pos, ttt, chunk, context))
        for w in range(2):
            for r in range(context, context + rows):
                out = head(tokens[w:w + 1, :r + 1], features[w:w + 1, :r + 1], position_ids=pos[w:w + 1, :r + 1])
                torch.testing.assert_close(unrolled[0][w, r - context], out.logits[0, -1], rtol=0, atol=1e-10)
                past, hidden = out.past_key_values, out.hidden_states[:, -1:]
                for s in range(1, ttt):
                    out = head(tokens[w:w + 1, r + s:r + s + 1], hidden, position_ids=pos[w:w + 1, r:r + 1] + s,
                               past_key_values=past)
                    torch.testing.assert_close(unrolled[s][w, r - context], out.logits[0, -1], rtol=0, atol=1e-10)
                    past, hidden = out.past_key_values, out.hidden_states[:, -1:]


def test_drawn_keys_are_the_true_tokens_and_features():
    """The drawn rows carry their own position's feature and next token (a data check, not geometry)."""
    data = {"tokens": torch.arange(200).view(2, 100), "features": torch.arange(200.).view(2, 100, 1),
            "final": torch.zeros(2, 100, 1)}
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        features, tokens, _, pos, context = train.sample_windows(gen, data, 3, 6, 2, 0, far=5)
        seq = (features[:, :1, 0] // 100).long()
        assert torch.equal(features[..., 0].long(), seq * 100 + pos)
        assert torch.equal(tokens[:, :context + 6], seq * 100 + pos + 1)
        assert bool((pos[:, :context] >= 0).all()) and context == 5


def _recall_data(length: int = 400):
    """Two sequences: a recall sequence at distance 96 (distinct tokens but for its copies), then plain text."""
    from calibrate.recall import recall_sequences

    r = recall_sequences(iter(range(10_000)), length, 2, distances=(96, 7936))
    tokens = torch.stack([torch.tensor(r[0].ids), 5000 + torch.arange(length)])
    copied = torch.stack([torch.from_numpy(r[0].copied), torch.zeros(length, dtype=torch.bool)])
    return {"tokens": tokens, "features": torch.zeros(2, length, 1), "final": torch.zeros(2, length, 1),
            "copied": copied}, r[0]


def test_match_keys_are_the_copy_sources():
    """In a copy, row p's match key is p + 1 - D (its two tokens are the row's two tokens), and with room
    for every match all of them are drawn, whatever the uniform keys."""
    data, seq = _recall_data()
    p = 96 + 10  # the second copy of the first block runs from 96 for 48 tokens
    assert bool(seq.copied[p]) and bool(seq.copied[p + 1])
    found = train.match_positions(data["tokens"][0], p, 0, 5)
    assert found.tolist() == [q + 1 - 96 for q in range(p, p + 5) if seq.copied[q + 1]]
    gen = torch.Generator().manual_seed(0)
    drawn = train._draw_far(gen, data["tokens"][0], p, 0, 5, far=20, match=8)
    assert set(found.tolist()) <= set(drawn.tolist()) and len(set(drawn.tolist())) == 20
    assert bool((drawn < p).all()) and bool((drawn[1:] > drawn[:-1]).all())
    plain = train._draw_far(gen, data["tokens"][1], 200, 0, 5, far=20, match=8)  # no repeats: no match keys
    assert len(train.match_positions(data["tokens"][1], 200, 0, 5)) == 0 and len(plain) == 20


def test_copy_share_weights_the_sequences_whose_copies_a_head_reaches():
    data, _ = _recall_data()
    w = train.copy_weights(data, 0.5, reach=256)
    assert torch.allclose(w, torch.tensor([0.25 + 0.5, 0.25], dtype=torch.float64))
    assert train.copy_weights(data, 0.5, reach=64) is None  # distance 96 is out of reach
    assert train.copy_weights(data, 0.0, reach=256) is None


def test_copied_flags_are_those_of_the_guessed_tokens():
    """With ``copied=True`` each row's flag at step s is the copied mask of token p + 2 + s, the token the
    loss compares that row with (a flag off by one would weight the passage's first token, which the
    row cannot copy)."""
    data, _ = _recall_data()
    gen = torch.Generator().manual_seed(3)
    *_, pos, context, flags = train.sample_windows(gen, data, 4, 30, 3, 0, copied=True)
    assert flags.shape == (4, 30, 3) and context == 0
    for w in range(4):  # the window's sequence is not returned: one of the two must match
        p = pos[w]  # (30,) positions of the rows
        for seq in range(2):
            want = data["copied"][seq][(p[:, None] + 2 + torch.arange(3)).clamp(max=399)]
            if torch.equal(flags[w], want) and (seq == 0 or not want.any()):
                break
        else:
            pytest.fail(f"window {w}: flags are not the copied mask of the guessed tokens")
    assert flags.any()  # some window lands in the recall sequence's copies


@pytest.mark.parametrize("script, args, named", [
    ("train_demo_eagle3", ["--copy-share", "1.5"], "--copy-share 1.5"),
    ("train_demo_eagle3", ["--copy-weight", "0"], "--copy-weight 0.0"),
    ("train_demo_eagle3", ["--copy-weight", "nan"], "--copy-weight nan"),
    ("train_demo_eagle3", ["--match", "3"], "--match 3"),  # more match keys than --far 0 draws
    ("train_demo_eagle3", ["--device", "gpu"], "--device gpu"),
    ("target_features", ["--per-source", "two"], "--per-source two"),
    ("target_features", ["--per-source", "1,2", "--sources", "pydoc:train"], "--per-source 1,2"),
    ("target_features", ["--per-source", "0"], "--per-source 0"),
    ("target_features", ["--device", "tpu:0"], "--device tpu:0"),
    ("target_features", ["--skip", "-1"], "--skip -1"),
    ("target_features", ["--skip", "ten"], "--skip ten"),
    ("target_features", ["--skip", "0,0,0"], "--skip 0,0,0"),  # three counts for the two default sources
])
def test_training_options_are_refused_in_one_line_before_any_work(tmp_path, monkeypatch, script, args, named):
    """Each script exits with one line naming the value (SystemExit with a message: exit status 1), before
    the target loads or anything is written."""
    import calibrate.smollm2

    module = train if script == "train_demo_eagle3" else features
    monkeypatch.setattr(module, "load_smollm2", lambda *a, **k: pytest.fail("the target loaded"), raising=False)
    monkeypatch.setattr(calibrate.smollm2, "load_smollm2", lambda *a, **k: pytest.fail("the target loaded"))
    work = ["--work", str(tmp_path / "work")] if script == "train_demo_eagle3" else []
    monkeypatch.setattr(sys, "argv", [script, *args, "--out", str(tmp_path / "out"), *work])
    with pytest.raises(SystemExit) as stop:
        module.main()
    assert isinstance(stop.value.code, str) and named in stop.value.code and "\n" not in stop.value.code
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


@pytest.mark.parametrize("source", ["pydoc:train", "recall:pydoc:train"])
def test_a_second_folder_with_skip_continues_the_text_of_the_first(source):
    """target_features --skip N plans exactly the sequences after the first N of a longer plan: a source is
    consumed in order, so two folders (the second with --skip) hold consecutive text, none of it twice."""

    class Chars:  # a tokenizer of code points: the plan depends only on encode and the eos id
        eos_token_id = 0

        @staticmethod
        def encode(text, add_special_tokens=False):
            return [1 + ord(c) % 500 for c in text]

    both = features.plan_sequences(Chars, [source], 256, 256 * 8, [8])
    first = features.plan_sequences(Chars, [source], 256, 256 * 3, [3])
    rest = features.plan_sequences(Chars, [source], 256, 256 * 5, [5], [3])
    assert [s[1] for s in first + rest] == [s[1] for s in both] and len(both) == 8
    assert [s[2] for s in first + rest] == [s[2] for s in both]  # the copied masks too (None for plain text)
