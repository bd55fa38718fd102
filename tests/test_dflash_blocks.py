"""DFlash blocks in the one speculative loop and in the teacher-forced pass (calibrate.drafters.blocks).

* many blocks in one call (``anchored_masks``) equal one block at a time, in full and sliding layers,
  with and without a scale, a window and sinks;
* block drafting in ``speculative_generate`` equals target-only greedy decoding, drafts ``B - 1``
  tokens per drafter forward, and under sampling repeats with its seed;
* a window of W leaves a block alone while its anchor sees at most W keys;
* distance fixes (clamp, group, pi, alone and with the scale) run in blocks: many in one call equal one at a
  time, drafting with them equals target-only greedy decoding, and they change nothing until a pair is far.

The sampling law of block drafting (drafts drawn in one go, each row from its own law) is checked by
Monte Carlo in tests/test_sampling.py.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from calibrate.drafters.blocks import (DFlashBlockProposer, _embed, anchored_masks, block_ids, block_tap,
                                       block_teacher_forced, context_columns)
from calibrate.drafters.dflash import DFlashAdapter, load_dflash
from calibrate.errors import UserError
from calibrate.speculative import Sampling, greedy_generate, speculative_generate
from sharpdraft_theory.positions import PositionFix
from sharpdraft_theory import ScaleSpec

from tiny_checkpoints import tiny_target, write_tiny_dflash

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

BS = 4
T = 40


@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


@pytest.fixture(scope="module")
def model(target, tmp_path_factory):
    return load_dflash(write_tiny_dflash(tmp_path_factory.mktemp("dflash"), target, seed=2, block_size=BS), target)


@pytest.fixture(scope="module")
def sliding(target, tmp_path_factory):
    """Layer 0 a sliding window of 6 (smaller than some contexts, larger than the block), layer 1 full."""
    folder = write_tiny_dflash(tmp_path_factory.mktemp("dflash-sliding"), target, seed=4, block_size=BS)
    config = json.loads((folder / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=6, use_sliding_window=True)
    (folder / "config.json").write_text(json.dumps(config))
    return load_dflash(folder, target)


@pytest.fixture(scope="module")
def text():
    return torch.randint(0, 255, (1, T), generator=torch.Generator().manual_seed(3))


def _window(w, sinks=None):
    return ScaleSpec(law="constant", n_ref=None, slope=0.0, top_k=4, window=w, sinks=sinks)


def _fixed(fix, slope=0.0, **kw):
    law = "log-linear" if slope else "constant"
    return ScaleSpec(law=law, n_ref=8, slope=slope, top_k=4,
                     positions=PositionFix(fix, n_ref=8 if fix == "pi" else None, **kw))


SPECS = {
    "none": None,
    "scale": ScaleSpec(law="log-linear", n_ref=8, slope=0.5, top_k=4),
    "window": _window(8),
    "sinks": _window(6, sinks=2),
    "clamp": _fixed("clamp", window=6),
    "group": _fixed("group", window=6, group=3),
    "pi": _fixed("pi"),
    "clamp+spec": _fixed("clamp", slope=0.5, window=6),
}


@torch.no_grad()
def one_block_logits(model, target, text, p, spec):
    """Row 1's logits of the block at ``p`` run alone, its context cut by ``context_columns``, scaled by hand."""
    from calibrate.drafters.target import hidden_state_features

    feats = hidden_state_features(target, text, model.config.hidden_state_ids)
    ctx = model.encode_context(feats, torch.arange(T)[None])
    keep = context_columns(spec, p)
    ctx = [(k[:, :, :p], v[:, :, :p]) if keep is None else (k[:, :, keep], v[:, :, keep]) for k, v in ctx]
    ids, pos = block_ids(model, torch.tensor([p]), text[0, p:p + 1])
    masks = None
    if keep is not None and model.config.layer_types:  # a sliding layer's mask over the kept keys
        masks = [_kept_mask(model, i, p, keep) for i in range(model.config.num_hidden_layers)]
    with block_tap(model, spec):
        hidden = model.forward_block(_embed(model, target, ids), pos, ctx, masks, context_positions=keep)
    return target.get_output_embeddings()(hidden[0, 1])


def _kept_mask(model, layer, p, keep):
    full = model.visible_mask(layer, p, BS)
    if full is None:
        return None
    return torch.cat((full[..., keep], full[..., p:]), dim=-1)


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("which", ["full", "sliding"])
def test_many_blocks_in_one_call_equal_one_at_a_time(name, which, model, sliding, target, text):
    m = model if which == "full" else sliding
    spec = SPECS[name]
    out = block_teacher_forced(m, target, text, m.config.hidden_state_ids, [(spec, None)])
    assert out.drafted.shape == (1, T) and out.target_next.shape == (T,)
    for p in (0, 1, 5, 9, 17, 33, T - 1):  # inside and across the batched chunks
        alone = one_block_logits(m, target, text, p, spec)
        assert int(out.drafted[0, p]) == int(alone.argmax())
    # the target's greedy token after position t is row t's
    assert torch.equal(out.target_next, target(text).logits[0].argmax(-1))


def test_a_window_leaves_a_block_alone_up_to_its_width(model, target, text):
    runs = [(None, None), (_window(8), None), (_window(6, sinks=2), None)]
    out = block_teacher_forced(model, target, text, model.config.hidden_state_ids, runs, temperature=0.7)
    # rows t <= 7 (n = t + 1 <= 8): equal; later rows: the window drops context keys, so some differ
    assert torch.allclose(out.accept[1, :8], out.accept[0, :8], atol=1e-6)
    assert torch.allclose(out.accept[2, :8], out.accept[0, :8], atol=1e-6)
    assert not torch.allclose(out.accept[1, 8:], out.accept[0, 8:], atol=1e-3)


def test_block_teacher_forced_matches_the_adapter(model, target, text):
    drafter = DFlashAdapter(model, target, tokenizer=None)
    out = drafter.teacher_forced(text, [(None, None)])
    assert drafter.predicts == 1 and out.drafted.shape == (1, T)


def test_one_block_forward_per_verification(model, target):
    """B - 1 drafts from each forward, fewer only at the end (the output is held to the target's in
    tests/test_conformance.py)."""
    prompt = torch.randint(0, 255, (1, 12), generator=torch.Generator().manual_seed(7))
    drafter = DFlashBlockProposer(model, target)
    out = speculative_generate(target, drafter, prompt, 20, num_draft=BS - 1)
    assert drafter.forwards == out.steps and out.drafter == "dflash"


def test_a_draft_of_k_rows_is_the_blocks_first_k(model, target, text):
    """Only the rows a verification reads go through the output head: the same numbers as the whole block's."""
    from calibrate.drafters.target import hidden_state_features

    feats = hidden_state_features(target, text, model.config.hidden_state_ids)
    drafter = DFlashBlockProposer(model, target)
    drafter.start(text[:, :30], feats[:, :30], int(text[0, 30]))
    whole = drafter.block_logits()
    assert whole.shape[0] == BS - 1
    for k in (1, BS - 2, BS - 1, BS + 3):
        part = drafter.block_logits(k)
        assert part.shape[0] == min(k, BS - 1)
        # the same forward, cut before the head: float32 rounding of the head's matmul on fewer rows
        torch.testing.assert_close(part, whole[:min(k, BS - 1)], rtol=1e-5, atol=1e-6)


def test_self_consistent_blocks_accept(model, target):
    """A drafter whose block rows copy the target's greedy tokens is accepted in full: the loop
    commits B - 1 drafts plus its own token per step (checks what the loop does with a whole block)."""
    prompt = torch.randint(0, 255, (1, 10), generator=torch.Generator().manual_seed(8))
    base = greedy_generate(target, prompt, 13)

    class Oracle(DFlashBlockProposer):
        def block_logits(self, rows=None):
            self.forwards += 1
            done = self.length + 1 - prompt.shape[1]  # tokens generated so far (the pending one included)
            rows = base.tokens[done:done + BS - 1] + [0] * BS
            return torch.nn.functional.one_hot(torch.tensor(rows[:BS - 1]), 256).float()

    out = speculative_generate(target, Oracle(model, target), prompt, 13, num_draft=BS - 1)
    assert out.tokens == base.tokens
    assert out.accepted == [BS - 1] * 3  # the prefill's token, then 3 steps of 3 drafts + 1 = 13


def test_block_sampling_repeats_with_its_seed(model, target):
    prompt = torch.randint(0, 255, (1, 8), generator=torch.Generator().manual_seed(9))
    runs = [speculative_generate(target, DFlashBlockProposer(model, target), prompt, 12, BS - 1,
                                 rule=Sampling(0.8, (1, 2))).tokens for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("name", ["clamp", "group", "pi", "clamp+spec"])
def test_a_distance_fix_changes_a_block_only_past_its_window(name, model, target, text):
    """Rows whose every pair is near (clamp, group: distance < 6; pi: row before n_ref 8) equal none exactly;
    later rows differ (the fix is applied, not dropped)."""
    runs = [(None, None), (SPECS[name], None)]
    out = block_teacher_forced(model, target, text, model.config.hidden_state_ids, runs, temperature=0.7)
    spec = SPECS[name]
    # the batched call of anchors 0 .. 31 holds rows up to 31 + B - 1: only a call wholly near keeps the kernel,
    # so compare one block at a time there
    limit = 8 - BS if name.startswith("pi") else 6 - BS  # anchors whose rows p .. p + B - 1 are all near
    for p in range(0, limit + 1):
        torch.testing.assert_close(one_block_logits(model, target, text, p, spec),
                                   one_block_logits(model, target, text, p, None), rtol=0, atol=0)
    assert not torch.allclose(out.accept[1, 12:], out.accept[0, 12:], atol=1e-3)
    if spec.law == "constant":  # the fix alone: far rows differ by the remapping only, the drafts mostly agree
        assert (out.drafted[1] == out.drafted[0]).float().mean() > 0.3


def test_attention_at_named_positions_equals_the_slot_path():
    """positions.attention_at (any positions, eager math) against remapped_attention (keys at their slots,
    tested against the definition in tests/test_positions*.py), with a causal mask and a non-causal block."""
    from sharpdraft_runtime.positions import attention_at, remapped_attention

    g = torch.Generator().manual_seed(0)
    B, kv, groups, q_len, k_len, D = 1, 2, 3, 5, 29, 8
    q = torch.randn(B, kv * groups, q_len, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, kv, k_len, D, generator=g, dtype=torch.float64) for _ in range(2))
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    q_pos, k_pos = torch.arange(k_len - q_len, k_len), torch.arange(k_len)
    causal = k_pos[None] <= q_pos[:, None]
    block = causal.clone()
    block[:, k_len - q_len:] = True  # the block's rows see one another
    for fix in (PositionFix("clamp", window=6), PositionFix("group", window=6, group=3), PositionFix("pi", n_ref=8)):
        for visible in (causal, block):
            want = remapped_attention(q, k, v, 0.3, fix, inv_freq, visible[None, None])
            got = attention_at(q, k, v, 0.3, fix, inv_freq, q_pos, k_pos, visible[None, None])
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_masks_keep_blocks_apart(model):
    masks = anchored_masks(model, torch.tensor([2, 5]), 5)
    m = masks[0][0, 0]  # (2B, 5 + 2B)
    assert m.shape == (2 * BS, 5 + 2 * BS)
    assert m[:BS, :2].all() and not m[:BS, 2:5].any()  # block at 2: context 0, 1 only
    assert m[BS:, :5].all()  # block at 5: context 0..4
    assert m[:BS, 5:5 + BS].all() and not m[:BS, 5 + BS:].any()  # its own block, not the other


# -- the commands ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from test_calibrate import VOCAB, _write_tokenizer

    root = tmp_path_factory.mktemp("dflash-cli")
    tiny = tiny_target(0, vocab_size=VOCAB)
    tiny.save_pretrained(root / "target")
    _write_tokenizer(root / "target")
    write_tiny_dflash(root / "dflash", tiny, seed=2, block_size=BS)
    (root / "corpus.txt").write_text(" ".join(["a block drafts every token of the next few at once"] * 40))
    return root


def test_eval_runs_a_dflash_drafter_end_to_end(folders, tmp_path):
    from typer.testing import CliRunner

    from calibrate.cli import app

    out = tmp_path / "eval.json"
    args = ["eval", "--drafter", "dflash", "--drafter-path", str(folders / "dflash"), "--target-path",
            str(folders / "target"), "--corpus", str(folders / "corpus.txt"), "--lengths", "16,64", "--sequences", "2",
            "--n-ref", "16", "--variants", "none,spec,window,sinks,clamp,clamp+spec", "--sinks", "2", "--device", "cpu",
            "--speculative", "--new-tokens", "8", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    r = json.loads(out.read_text())
    spec = r["speculative"]
    assert spec["outputs_identical"] is True and spec["num_draft"] == BS - 1
    assert spec["drafting"].startswith(f"block: up to {BS - 1} drafts from one drafter forward")
    assert set(spec["drafters"].values()) == {"dflash"}
    first = r["buckets"][0]  # n <= 16 = n_ref = the window: every variant is none there
    for variant in ("spec", "window", "sinks", "clamp", "clamp+spec"):
        assert first[variant]["delta_vs_none"]["agreement"][0] == 0, variant
    blocks = r["blocks"]  # per-position metrics of the B - 1 drafts of one forward
    assert blocks["draft_length"] == BS - 1 and [b["n"] for b in blocks["buckets"]] == [16, 64]
    cell = blocks["buckets"][1]["spec"]
    assert len(cell["agreement_by_position"]) == BS - 1 and 0 <= cell["expected_accepted_length"] <= BS - 1


def test_calibrate_selects_for_a_dflash_drafter(folders, tmp_path):
    from typer.testing import CliRunner

    from calibrate.cli import app

    out = tmp_path / "select.json"
    args = ["calibrate", "--drafter", "dflash", "--drafter-path", str(folders / "dflash"), "--target-path",
            str(folders / "target"), "--corpus", str(folders / "corpus.txt"), "--max-length", "256", "--sequences", "2",
            "--n-ref", "64", "--device", "cpu", "--select", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())["calibration"]["selection"]
    names = set(record["candidates"])
    assert {"none", "spec", "qwen-logn", "sinks", "window 64", "lookup", "clamp", "group", "pi", "clamp+spec"} <= names
    assert record["chosen"] in names


@pytest.mark.parametrize("extra,message", [
    (["--num-draft", "0"], "--num-draft 0: need at least 1"),
    (["--num-draft", "9"], "--num-draft 9: a block of 4 drafts at most 3 tokens a forward"),
])
def test_eval_refuses_what_blocks_do_not_run(folders, extra, message):
    from typer.testing import CliRunner

    from calibrate.cli import app

    args = ["eval", "--drafter", "dflash", "--drafter-path", str(folders / "dflash"), "--target-path",
            str(folders / "target"), "--corpus", str(folders / "corpus.txt"), "--lengths", "16,64", "--device", "cpu",
            *extra]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, UserError)  # main() prints it as one line and exits 1
    assert re.search(message, str(result.exception)), str(result.exception)


def test_the_runtime_enabled_on_a_dflash_model_drafts_what_eval_measures(model, target, text):
    """``sharpdraft_runtime.enable`` with a scale spec on the DFlash model gives the block drafter's logits
    (float32 rounding, 1e-5); a window, which a block cannot take through a causal mask, is refused."""
    import sharpdraft_runtime
    from calibrate.drafters.target import hidden_state_features

    spec = SPECS["scale"]
    feats = hidden_state_features(target, text, model.config.hidden_state_ids)
    drafter = DFlashBlockProposer(model, target, spec)
    drafter.start(text[:, :30], feats[:, :30], int(text[0, 30]))
    want = drafter.block_logits()
    ids, pos = block_ids(model, torch.tensor([30]), text[0, 30:31])
    context = model.encode_context(feats[:, :30], torch.arange(30)[None])
    with torch.no_grad():
        sharpdraft_runtime.enable(model, spec)
        try:
            got = target.get_output_embeddings()(model.forward_block(_embed(model, target, ids), pos, context)[0, 1:])
        finally:
            sharpdraft_runtime.disable(model)
        plain = target.get_output_embeddings()(model.forward_block(_embed(model, target, ids), pos, context)[0, 1:])
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    assert not torch.allclose(plain, want, atol=1e-3)  # the scale acts at 30 + 4 keys past n_ref = 8
    with pytest.raises(ValueError, match="drafts non-causal blocks"):
        sharpdraft_runtime.enable(model, SPECS["window"])


# float32 block logits on the compiled pass against the eager path: the attention outputs differ by float32 rounding
# (~1e-7, tests/test_positions.py bounds it against float64), carried through two layers and the output head to
# O(1) logits: ~1e-6; 1e-5 leaves a margin.
ATOL_COMPILED32 = 1e-5


@pytest.mark.parametrize("name", ["clamp", "group", "pi", "clamp+spec", "pi+spec"])
def test_a_blocks_compiled_distance_fix_drafts_what_the_eager_path_drafts(name, model, target, text, monkeypatch):
    """A block with a distance fix (alone and with the scale; GQA, 4 query heads over 2 key heads) takes the
    compiled pass (``sharpdraft_runtime.fused.block_logits``) when its keys are at their slots, float32 on the CPU;
    its row logits equal the eager path's (numba unavailable) at anchors whose block crosses the fix's threshold
    (pi: its rows straddle n_ref), lies just past it, and far past it."""
    from sharpdraft_runtime import fused

    spec = SPECS[name] if name in SPECS else _fixed("pi", slope=0.5)
    used = []
    real = fused.block_logits
    monkeypatch.setattr(fused, "block_logits", lambda *a, **k: used.append(1) or real(*a, **k))
    threshold = spec.positions.identity_limit
    for p in (threshold - 2, threshold + 1, 20, T - BS):
        used.clear()
        compiled = one_block_logits(model, target, text, p, spec)
        assert used  # the compiled pass served (this test can fail)
        monkeypatch.setattr(fused, "_KERNELS", False)  # as without numba, or under NUMBA_DISABLE_JIT=1
        eager = one_block_logits(model, target, text, p, spec)
        monkeypatch.setattr(fused, "_KERNELS", None)  # decided again: numba here
        torch.testing.assert_close(compiled, eager, rtol=0, atol=ATOL_COMPILED32)
    assert not torch.allclose(eager, one_block_logits(model, target, text, p, None), atol=1e-3)  # the fix acts
