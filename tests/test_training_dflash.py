"""``scripts/train_dflash.py``: the context-key rule, the batched block loss, a resumable run, bad options.

The loss of many blocks in one forward must be the loss of each block run alone over the keys it was
given (a block leaking into another, or seeing keys it was not given, would train a drafter on what
it cannot see at inference); the key rule must keep the local window and the match spans within the
budget; a short run on shards of random features writes a head that ``load_dflash`` reads with
SmolLM2 as its target, and a stopped run resumes.
"""

from __future__ import annotations

import json

import pytest
import torch

from calibrate.training import dflash


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)



def test_context_keys_keep_the_window_and_the_match_spans_within_the_budget():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 50, (400,), generator=g)
    tokens[100:110] = tokens[300:310]  # the block at 305 reads (x_304, x_305) = (x_104, x_105)
    p = 305
    seen = dflash.context_keys(g, tokens, p, context=64, local=32, match=2, block=6)
    assert int(seen.sum()) == 64 and not seen[p:].any()
    assert seen[p - 32:p].all()  # the local window
    assert seen[105:110].all()  # the match at 105 and the B - 1 positions after it
    few = dflash.context_keys(g, tokens, 40, context=64, local=32, match=2, block=6)
    assert int(few.sum()) == 40 and few[:40].all()  # fewer earlier positions than the budget: all of them


def test_blocks_in_one_forward_equal_each_block_alone():
    from calibrate.drafters.dflash import DFlashConfig, DFlashDraftModel

    torch.manual_seed(0)
    H, V, T, B = 32, 40, 30, 4
    config = DFlashConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                          num_hidden_layers=2, vocab_size=V, block_size=B, mask_token_id=V - 1,
                          target_layer_ids=(0, 1, 2), rope_theta=1000.0)
    model = DFlashDraftModel(config).double()
    embed = torch.nn.Embedding(V, H).double()
    lm_head = torch.randn(V, H, dtype=torch.float64)
    data = {"tokens": torch.randint(0, V - 1, (1, T)), "features": torch.randn(1, T, 3 * H, dtype=torch.float64),
            "final": torch.randn(1, T, H, dtype=torch.float64)}
    g = torch.Generator().manual_seed(1)
    anchors = torch.tensor([3, 11, 20])
    seen = torch.stack([dflash.context_keys(g, data["tokens"][0], int(p), 8, 4, 1, B) for p in anchors])
    together, _ = dflash.block_loss(model, embed, lm_head, data, 0, anchors, seen, 7.0)
    alone = [dflash.block_loss(model, embed, lm_head, data, 0, anchors[i:i + 1], seen[i:i + 1], 7.0)[0]
             for i in range(3)]
    # float64: sums of a few thousand O(1) products agree far below any real difference
    assert torch.allclose(together, torch.stack(alone).mean(), rtol=0, atol=1e-10)
    other = seen.clone()
    other[1, int(other[1].nonzero()[0])] = False  # one key fewer for block 2 changes its loss
    changed, _ = dflash.block_loss(model, embed, lm_head, data, 0, anchors, other, 7.0)
    assert abs(float((changed - together).detach())) > 1e-8


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Two sequences of 64 tokens with random SmolLM2-width features, in target_features.py's layout."""
    folder = tmp_path_factory.mktemp("shards")
    g = torch.Generator().manual_seed(2)
    for i in range(2):
        torch.save({"tokens": torch.randint(20, 5000, (64,), generator=g),
                    "features": torch.randn(64, 3 * 576, generator=g).half(),
                    "final": torch.randn(64, 576, generator=g).half()}, folder / f"seq-{i:05d}.pt")
    (folder / "manifest.json").write_text(json.dumps({"sequences": 2, "seq_len": 64, "per_source": {"test": 2}}))
    return folder


@pytest.mark.slow
def test_a_short_run_writes_a_head_smollm2_loads_and_resumes(shards, tmp_path, capsys):
    from calibrate.drafters.dflash import load_dflash
    from calibrate.smollm2 import load_smollm2

    argv = ["--features", str(shards), "--out", str(tmp_path / "head"), "--work", str(tmp_path / "work"),
            "--layers", "1", "--block", "4", "--context", "16", "--local", "8", "--anchors", "4", "--steps", "2",
            "--save-every", "1", "--intermediate", "64", "--check", "1", "--check-every", "1"]
    dflash.main(argv)
    record = json.loads((tmp_path / "head" / "training_log.json").read_text())
    assert record["n_ref"] == 20 and record["max_distance"] == 63 and record["steps_done"] == 2
    assert record["held_out"] == [1]  # sequence 1 is checked, never trained on
    checks = [h["check"] for h in record["history"]]
    assert len(checks) == 2 and all(len(c["agreement"]) == 3 and c["loss"] > 0 for c in checks)
    target, _ = load_smollm2()
    model = load_dflash(tmp_path / "head", target)
    assert model.config.hidden_state_ids == (2, 15, 27) and model.config.block_size == 4
    progress = tmp_path / "work" / "progress.pt"
    state = torch.load(progress, weights_only=False)
    del state["settings"]["layer_init"]  # a run saved before --layer-init existed was a random start
    torch.save(state, progress)
    dflash.main(argv)  # finished: resumes at its last step and writes nothing new
    assert "resuming at step 2/2" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="made with other options"):
        dflash.main([*argv, "--layer-init", "target", "--intermediate", "1536"])


@pytest.mark.parametrize("args,named", [
    (["--block", "1"], "--block 1"),
    (["--local", "300"], "--local 300"),
    (["--decay", "nan"], "--decay nan"),
    (["--lr", "-1"], "--lr -1.0"),
    (["--anchors", "0"], "--anchors 0"),
    (["--check", "-1"], "--check -1"),
    (["--check", "2"], "--check 2"),  # the shards hold 2 sequences: none left to train on
    (["--check-every", "0"], "--check-every 0"),
])
def test_bad_options_are_refused_in_one_line(shards, tmp_path, args, named):
    with pytest.raises(SystemExit) as stop:
        dflash.parse_args(["--features", str(shards), "--out", str(tmp_path / "h"), *args])
    assert named in str(stop.value)


def test_an_unknown_norm_init_is_refused_naming_it(shards, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        dflash.parse_args(["--features", str(shards), "--out", str(tmp_path / "h"), "--norm-init", "zeros"])
    assert stop.value.code != 0
    assert "--norm-init: invalid choice: 'zeros'" in capsys.readouterr().err


def test_held_out_sequences_are_spread_over_the_shards_and_distinct():
    assert dflash.held_out(320, 8) == [20, 60, 100, 140, 180, 220, 260, 300]
    for S in range(2, 40):
        for n in range(1, S):
            seqs = dflash.held_out(S, n)
            assert len(set(seqs)) == n and 0 <= min(seqs) and max(seqs) < S


def test_an_out_that_is_an_input_or_a_file_is_refused(shards, tmp_path):
    with pytest.raises(SystemExit, match="is also --features"):
        dflash.parse_args(["--features", str(shards), "--out", str(shards)])
    (tmp_path / "f").write_text("x")
    with pytest.raises(SystemExit, match="a file, not a folder"):
        dflash.parse_args(["--features", str(shards), "--out", str(tmp_path / "f")])
    assert (tmp_path / "f").read_text() == "x"


def test_features_without_a_manifest_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="no manifest.json"):
        dflash.parse_args(["--features", str(tmp_path), "--out", str(tmp_path / "h")])


def _more_shards(folder, count: int = 3, length: int = 64):
    """A second shard folder in target_features.py's layout (other random values)."""
    g = torch.Generator().manual_seed(3)
    folder.mkdir()
    for i in range(count):
        torch.save({"tokens": torch.randint(20, 5000, (length,), generator=g),
                    "features": torch.randn(length, 3 * 576, generator=g).half(),
                    "final": torch.randn(length, 576, generator=g).half()}, folder / f"seq-{i:05d}.pt")
    (folder / "manifest.json").write_text(json.dumps({"sequences": count, "seq_len": length,
                                                      "per_source": {"more": count}}))
    return folder


@pytest.mark.parametrize("features,named", [
    ("{a},{a}", "name each shard folder once"),
    ("{a},", "name each shard folder once"),
    ("{a},{missing}", "no manifest.json"),
    ("{a},{out}", "is also --features"),
])
def test_several_shard_folders_refuse_a_repeat_a_gap_or_the_out_folder(shards, tmp_path, features, named):
    text = features.format(a=shards, missing=tmp_path / "none", out=tmp_path / "h")
    (tmp_path / "h").mkdir()
    (tmp_path / "h" / "manifest.json").write_text("{}")
    with pytest.raises(SystemExit) as stop:
        dflash.parse_args(["--features", text, "--out", str(tmp_path / "h")])
    assert named in str(stop.value) and "\n" not in str(stop.value)


@pytest.mark.slow
def test_a_run_over_two_shard_folders_checks_on_the_first_and_trains_on_both(shards, tmp_path):
    more = _more_shards(tmp_path / "more")
    argv = ["--features", f"{shards},{more}", "--out", str(tmp_path / "head"), "--work", str(tmp_path / "work"),
            "--layers", "1", "--block", "4", "--context", "16", "--local", "8", "--anchors", "4", "--steps", "1",
            "--intermediate", "64", "--check", "1"]
    dflash.main(argv)
    record = json.loads((tmp_path / "head" / "training_log.json").read_text())
    assert record["held_out"] == [1]  # of the first folder's 2: the same check as that folder alone
    assert record["corpus"] == {"test": 2, "more": 3}
    assert f"--features {shards},{more}" in record["command"]
    short = _more_shards(tmp_path / "short", count=2, length=32)
    with pytest.raises(SystemExit, match=r"sequences of different lengths \(64, 32\)"):
        dflash.parse_args([*argv[:1], f"{shards},{short}", *argv[2:]])


def test_a_start_from_the_target_copies_its_last_layers_and_reads_its_residual_stream():
    """--layer-init target: layer i is the target's layer N - L + i; the context the first layer projects is
    the target's own input norm of the last feature (what that target layer would read there); q_norm /
    k_norm carry the root mean square of the target layer's queries / keys."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from calibrate.drafters.dflash import DFlashConfig, DFlashDraftModel

    torch.manual_seed(0)
    H = 32
    target = LlamaForCausalLM(LlamaConfig(hidden_size=H, intermediate_size=48, num_hidden_layers=5,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=40)).double()
    for p in target.parameters():  # norms away from 1, so that a copy is told from a default
        p.data += 0.1 * torch.randn_like(p)
    model = DFlashDraftModel(DFlashConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                                          intermediate_size=48, num_hidden_layers=2, vocab_size=40, block_size=4,
                                          mask_token_id=39, target_layer_ids=(0, 1, 2), rope_theta=1000.0)).double()
    features = torch.randn(20, 3 * H, dtype=torch.float64)
    scales = dflash.target_start(model, target, features)
    assert list(scales) == [3, 4]
    source = target.get_decoder().layers
    for mine, theirs in zip(model.layers, source[3:]):
        for name, weight in theirs.named_parameters():
            assert torch.equal(dict(mine.named_parameters())[name], weight), name
    resid = features[:, -H:]
    # float64, the same ops in another order: equal to rounding
    assert torch.allclose(model.hidden_norm(model.fc(features)), source[3].input_layernorm(resid), atol=1e-12)
    with torch.no_grad():
        q = source[4].self_attn.q_proj(source[4].input_layernorm(resid))
    assert torch.allclose(model.layers[1].self_attn.q_norm.weight, q.pow(2).mean().sqrt().expand(8), atol=1e-12)
    assert scales[4][0] == pytest.approx(float(q.pow(2).mean().sqrt()), rel=1e-12)
    assert torch.equal(model.norm.weight, target.get_decoder().norm.weight)


@pytest.mark.slow
@pytest.mark.parametrize("extra,named", [(["--intermediate", "64"], "give --intermediate 1536"),
                                         (["--layers", "31"], "at most 30 --layers")])
def test_a_start_from_the_target_needs_its_shape(shards, tmp_path, extra, named):
    argv = ["--features", str(shards), "--out", str(tmp_path / "head"), "--work", str(tmp_path / "work"),
            "--layer-init", "target", "--block", "4", "--check", "1", *extra]
    with pytest.raises(SystemExit) as stop:
        dflash.main(argv)
    assert named in str(stop.value) and "--layer-init target" in str(stop.value)
    assert not (tmp_path / "head").exists() and not (tmp_path / "work").exists()


def test_an_unknown_layer_init_is_refused_naming_it(shards, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        dflash.parse_args(["--features", str(shards), "--out", str(tmp_path / "h"), "--layer-init", "smollm2"])
    assert stop.value.code != 0
    assert "--layer-init: invalid choice: 'smollm2'" in capsys.readouterr().err

