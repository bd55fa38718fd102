"""The copy circuit (calibrate.drafters.induction) and its fitting script's option checks.

* the codes' slots and rotation are the head's own RoPE: a query/key product through
  :func:`rotate_codes` equals the one through the head's ``apply_rope`` on full head vectors;
* a head grown by a group with a zero output computes exactly what it did (logits, hidden states
  and the cached keys and values of its own heads), prefill and decoding alike;
* on a hand-built head whose features carry their own token, the grown head copies: where the known
  token occurred before, it drafts the token that followed it, and where it did not, what it drafted
  before (unless it sees a single key, whose value softmax then takes whole);
* the match loss is the attention mass on the target rows, checked by hand;
* bad options of scripts/induction_head.py (calibrate.training.induction) are refused in one line before
  any model loads.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from calibrate.drafters.eagle3 import Eagle3Config, Eagle3Head
from calibrate.drafters.induction import low_frequency_slots, match_loss, rotate_codes, with_copy_group
from calibrate.drafters.layers import apply_rope, rope_cos_sin, rope_inv_freq
from calibrate.training import induction as induction_head

ROOT = Path(__file__).resolve().parent.parent


def tiny_head(seed: int = 0, hidden: int = 16, vocab: int = 32, theta: float = 10000.0, head_dim: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    config = Eagle3Config(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, intermediate_size=24,
                          vocab_size=vocab, draft_vocab_size=vocab, max_position_embeddings=64, rope_theta=theta,
                          head_dim=head_dim)
    head = Eagle3Head(config)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
        head.d2t.zero_()
    return head.eval()


def test_slots_are_the_lowest_frequency_pairs_and_bad_counts_are_refused():
    assert low_frequency_slots(8, 2) == [2, 3, 6, 7]
    assert low_frequency_slots(8, 4) == list(range(8))
    for bad in (0, 5):
        with pytest.raises(ValueError, match="pairs"):
            low_frequency_slots(8, bad)


def test_rotated_codes_give_the_heads_own_rope_products():
    d, pairs, theta, rows = 16, 3, 500.0, 40
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(rows, 2 * pairs, generator=gen), torch.randn(rows, 2 * pairs, generator=gen)
    inv_freq, _ = rope_inv_freq(d, theta)
    positions = torch.arange(rows)
    ours = rotate_codes(q, inv_freq[d // 2 - pairs:], positions) @ rotate_codes(k, inv_freq[d // 2 - pairs:], positions).T
    slots = torch.tensor(low_frequency_slots(d, pairs))
    full_q, full_k = torch.zeros(1, 1, rows, d), torch.zeros(1, 1, rows, d)
    full_q[0, 0][:, slots], full_k[0, 0][:, slots] = q, k
    cos, sin = rope_cos_sin(positions[None], d, theta, torch.float32)
    theirs = apply_rope(full_q, cos, sin)[0, 0] @ apply_rope(full_k, cos, sin)[0, 0].T
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)  # fp32 rotation of O(1) numbers


def test_a_group_with_zero_output_changes_nothing():
    head = tiny_head()
    c = head.config
    gen = torch.Generator().manual_seed(2)
    maps = (torch.randn(4, c.hidden_size, generator=gen), torch.randn(4, c.hidden_size, generator=gen),
            torch.randn(c.head_dim, c.hidden_size, generator=gen))
    grown = with_copy_group(head, *maps, torch.zeros(c.hidden_size, c.head_dim)).eval()
    assert (grown.config.num_attention_heads, grown.config.num_key_value_heads) == (6, 3)
    ids = torch.randint(0, c.vocab_size, (1, 12), generator=gen)
    feats = torch.randn(1, 12, 3 * c.hidden_size, generator=gen)
    with torch.no_grad():
        a, b = head(ids, feats), grown(ids, feats)
        torch.testing.assert_close(b.logits, a.logits, rtol=0, atol=1e-5)  # fp32, the same sums reordered at most
        torch.testing.assert_close(b.past_key_values[0][:, :2], a.past_key_values[0], rtol=0, atol=1e-6)  # a wider matmul
        step_a = head(ids[:, -1:], a.hidden_states[:, -1:], past_key_values=a.past_key_values)
        step_b = grown(ids[:, -1:], b.hidden_states[:, -1:], past_key_values=b.past_key_values)
        torch.testing.assert_close(step_b.logits, step_a.logits, rtol=0, atol=1e-5)


def test_the_grown_head_copies_the_token_that_followed():
    vocab = hidden = 16
    # heads of 32 dimensions: the 8 lowest-frequency pairs hold a one-hot code of the 16 tokens, and at
    # theta 1e9 they turn by at most 3e-5 radians a row
    head = tiny_head(hidden=hidden, vocab=vocab, theta=1e9, head_dim=32)
    c = head.config
    eye = torch.eye(hidden)
    with torch.no_grad():  # a head that, alone, drafts its row's own token: features carry it, nothing else acts
        head.embed_tokens.weight.copy_(eye)
        head.fc.weight.copy_(torch.cat((eye, torch.zeros(hidden, 2 * hidden)), dim=1))
        for norm in (head.midlayer.hidden_norm, head.midlayer.input_layernorm, head.midlayer.post_attention_layernorm,
                     head.norm):
            norm.weight.fill_(1.0)
        head.midlayer.self_attn.o_proj.weight.zero_()
        head.midlayer.mlp.down_proj.weight.zero_()
        head.lm_head.weight.copy_(eye)
    wide = torch.cat((eye, torch.zeros(c.head_dim - hidden, hidden)))  # (head_dim, H): the token, padded
    grown = with_copy_group(head, 20.0 * eye, eye, wide, 40.0 * wide.T)
    text = torch.tensor([3, 7, 1, 9, 5, 3, 7, 1, 2])
    features = torch.cat((eye[text], torch.zeros(len(text), 2 * hidden)), dim=1)  # position t carries token t
    with torch.no_grad():
        before = head(text[1:][None], features[:-1][None]).logits[0].argmax(-1)
        after = grown(text[1:][None], features[:-1][None]).logits[0].argmax(-1)
    assert before.tolist() == text[:-1].tolist()  # alone: its row's own token
    # row t knows token t + 1; rows 4, 5 and 6 know 3, 7 and 1, seen at positions 0, 1 and 2: they draft
    # what followed there (7, 1, 9). Rows 1-3 find no match and spread over their keys, so their own
    # token still wins; row 0 sees one key only, its own, and takes its value whatever it is (softmax)
    assert after[4:7].tolist() == [7, 1, 9]
    assert after[1:4].tolist() == text[1:4].tolist()
    assert after[0].item() == text[1].item()


def test_the_match_loss_is_minus_the_log_mass_on_the_target_rows():
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    k = torch.tensor([[2.0, 0.0], [0.0, 0.0]])
    same = torch.tensor([[True, False], [False, True]])
    visible = torch.tensor([[True, False], [True, True]])
    # row 0 sees only its target: mass 1; row 1 sees logits 0 and 0, target one of two: mass 1/2
    loss = match_loss(q, k, same, visible, scaling=1.0)
    assert math.isclose(loss.item(), (0.0 + math.log(2)) / 2, rel_tol=1e-6)
    assert match_loss(q, k, torch.zeros(2, 2, dtype=torch.bool), visible, 1.0).item() == 0.0


@pytest.mark.parametrize("argv, message", [
    (["--epochs", "-1"], "--epochs -1"),
    (["--lr", "nan"], "--lr nan"),
    (["--lr", "0"], "--lr 0"),
    (["--check", "0"], "--check 0"),
    (["--window", "1"], "--window 1"),
    (["--threads", "0"], "--threads 0"),
    (["--head", "/nonexistent"], "--head /nonexistent"),
    (["--features", "/nonexistent"], "--features /nonexistent"),
    (["--out", "calibrate/assets/eagle3-smollm2"], "is the --head folder"),
    (["--scales", "1,-2"], "'1,-2'"),
    (["--scales", "inf"], "'inf'"),
    (["--scales", ""], "''"),
    (["--scale", "-1"], "--scale -1"),
    (["--scale", "nan"], "--scale nan"),
    (["--pairs", "33"], "--pairs 33: give 1 to head_dim / 2 = 32"),
    (["--check", "5"], "--check 5: the features hold 5 shards"),
    (["--check-features", "/nonexistent"], "--check-features /nonexistent"),
    (["--check-features", "FEATS"], "is the --features folder"),
    (["--check-features", "HELD", "--check", "4"], "--check 4: --check-features holds 3 shards"),
    (["--features", "DAMAGED"], "cannot be read"),
])
def test_bad_options_are_refused_before_any_model_loads(tmp_path, monkeypatch, capsys, argv, message):
    """parse() checks every option before main() loads a model (those the head's config and the shard
    manifests refute included); an argparse type error says the value."""
    folders = {"FEATS": ("feats", '{"sequences": 5}'), "HELD": ("held", '{"sequences": 3}'),
               "DAMAGED": ("damaged", '["not", "a", "manifest"]')}
    for name, text in folders.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(text)
    argv = [str(tmp_path / folders[a][0]) if a in folders else a for a in argv]
    monkeypatch.chdir(ROOT)
    base = ["--features", str(tmp_path / "feats"), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as e:
        induction_head.parse([*base, *argv])
    said = f"{e.value.code}\n{capsys.readouterr().err}"
    assert message in said, said
    assert "Traceback" not in said
    assert not (tmp_path / "out").exists()


def test_good_options_pass(tmp_path, monkeypatch):
    for name, count in (("feats", 5), ("held", 3)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(f'{{"sequences": {count}}}')
    monkeypatch.chdir(ROOT)
    base = ["--features", str(tmp_path / "feats"), "--out", str(tmp_path / "out"), "--pairs", "32"]
    assert induction_head.parse([*base, "--check", "4"]).check == 4
    args = induction_head.parse([*base, "--check-features", str(tmp_path / "held"), "--check", "3"])
    assert args.check_features == tmp_path / "held"


def test_the_match_masks_by_hand():
    masks = induction_head.masks
    tokens = torch.tensor([5, 1, 5, 2, 5, 1])  # head rows 0..4 know tokens 1, 5, 2, 5, 1
    same, visible = masks(tokens, window=3)
    assert visible[4].tolist() == [False, False, True, True, True]  # the last 3 rows, itself included
    # row 3 knows 5, held by key rows 0 and 2 (tokens 0 and 2); with the token before (2, at row 3's
    # position 3) it must also follow a 2: only key row 4 would, and it lies ahead
    assert torch.nonzero(same[3]).flatten().tolist() == [0, 2, 4]
    same2, _ = masks(tokens, window=3, bigram=True)
    assert torch.nonzero(same2[3]).flatten().tolist() == [4]
    # row 4 knows 1 after 5: key row 1 holds 1 after 5 (tokens 0, 1)
    assert torch.nonzero(same2[4]).flatten().tolist() == [1]


def test_maps_reading_both_halves_are_placed_whole():
    head = tiny_head()
    c = head.config
    h = c.hidden_size
    query, key = torch.randn(4, 2 * h), torch.randn(4, 2 * h)
    grown = with_copy_group(head, query, key, torch.zeros(c.head_dim, h), torch.zeros(h, c.head_dim))
    slots = torch.tensor(low_frequency_slots(c.head_dim, 2))
    q0, k0 = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attn = grown.midlayer.self_attn
    assert torch.equal(attn.q_proj.weight[q0 + slots], query) and torch.equal(attn.k_proj.weight[k0 + slots], key)
    with pytest.raises(ValueError, match="2P"):
        with_copy_group(head, torch.randn(4, h), torch.randn(6, h), torch.zeros(c.head_dim, h), torch.zeros(h, c.head_dim))


def test_the_output_map_reads_each_token_back_as_itself():
    """The fitted output map, through the head's norm weight and lm_head, ranks each occurring draft token
    first from its own value: 12 occurring tokens of 32, whose 16-wide values a linear map can send anywhere."""
    head = tiny_head(seed=4, hidden=16, vocab=32, head_dim=16)
    fit = [{"tokens": torch.arange(12).repeat(3)}]
    value = torch.linalg.qr(torch.randn(16, 16, generator=torch.Generator().manual_seed(5)))[0].T  # (D, H)
    output = induction_head.read_back_output(head, value, fit)
    assert output.shape == (16, 16)
    with torch.no_grad():
        carried = head.midlayer.input_layernorm(head.embed_tokens(torch.arange(12))) @ value.T
        logits = head.lm_head((carried @ output.T) * head.norm.weight)
    assert (logits.argmax(-1) == torch.arange(12)).all()


def test_the_ridge_key_map_recovers_a_linear_code_and_explains_noise_not_at_all():
    """The key map's ridge: a code that is a linear function of the inputs is recovered (its map, to the
    ridge's small bias, and R^2 near 1); a code independent of them is hardly explained (R^2 is bounded by
    its columns over its rows)."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(4000, 12, generator=gen)
    truth = torch.randn(3, 12, generator=gen)
    fitted, explained = induction_head.ridge(x, x @ truth.T)
    assert fitted.shape == (3, 12) and explained > 0.999
    assert torch.allclose(fitted, truth, atol=1e-3)
    assert abs(induction_head.ridge(x, torch.randn(4000, 3, generator=gen))[1]) < 0.01


def test_progress_of_other_settings_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    """A --work folder whose saved settings differ is refused in one line; the same settings resume."""
    (tmp_path / "feats").mkdir()
    (tmp_path / "feats" / "manifest.json").write_text('{"sequences": 5}')
    monkeypatch.chdir(ROOT)
    base = ["--features", str(tmp_path / "feats"), "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
            "--check", "2"]
    work, settings, saved = induction_head.saved_progress(induction_head.parse(base))
    assert saved is None and work == tmp_path / "work"
    work.mkdir()
    torch.save({"settings": settings, "epochs": 3}, work / "progress.pt")
    resumed = induction_head.saved_progress(induction_head.parse([*base, "--epochs", "9", "--scale", "2"]))
    assert resumed[2]["epochs"] == 3
    with pytest.raises(SystemExit) as e:
        induction_head.saved_progress(induction_head.parse([*base, "--bigram"]))
    assert "holds progress of other settings" in str(e.value.code) and "\n" not in str(e.value.code)
