"""The copy pointer (``calibrate.drafters.pointer``): its match, its law, its file, and an EAGLE-3
head drafting with it (teacher-forced and in the chain loop, greedy and sampled)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from calibrate.drafters.eagle3 import Eagle3Adapter, load, load_eagle3_head
from calibrate.drafters.pointer import FILE, UNMATCHED, CopyPointer, keeping_slope, matches, read, write
from calibrate.errors import UserError
from calibrate.speculative import GREEDY, prefill, speculative_generate
from sharpdraft_theory import ScaleSpec

from tiny_checkpoints import tiny_target, write_tiny_eagle3

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)


def brute_matches(tokens: list[int], lo: int, hi: int, order: int) -> np.ndarray:
    out = np.zeros((hi - lo, hi))
    for t in range(lo, hi):
        for i in range(hi):
            m = 0
            while m < order and t + 1 - m >= 0 and i - m >= 0 and tokens[t + 1 - m] == tokens[i - m]:
                m += 1
            out[t - lo, i] = m
    return out


@settings(derandomize=True, max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=3, max_size=24), st.integers(1, 4), st.data())
def test_matches_are_common_suffix_lengths(tokens, order, data):
    hi = data.draw(st.integers(1, len(tokens) - 1))
    lo = data.draw(st.integers(0, hi - 1))
    got = matches(torch.tensor(tokens), lo, hi, order).numpy()
    np.testing.assert_array_equal(got, brute_matches(tokens, lo, hi, order))


def _mix(pointer, head_logits, tokens, alpha=1.0, **kw):
    columns = torch.tensor([0, 2, 3, 5])  # a draft vocabulary of 4 of the 8 target ids
    rows = torch.arange(head_logits.shape[0])
    return pointer.mix(head_logits, columns, torch.tensor(tokens), rows, alpha, 8, **kw), columns


def brute_law(pointer, head_logits, columns, tokens, t, alpha, vocab, window, sinks, shift) -> np.ndarray:
    """The module docstring's law for row ``t``, key by key in float64: the reference for both paths of mix."""
    match = brute_matches(tokens, t, t + 1, pointer.order)[0]
    weights, sink = [], math.exp(alpha * pointer.sink)
    for i in range(t + 1):
        seen = (window is None or i > t - window or (sinks or 0) > i) and i + shift <= t + 1
        seen = seen and (pointer.unmatched == "scored" or match[i] > 0)  # a masked pointer's unmatched: no key
        weights.append(math.exp(alpha * pointer.scale * match[i]) if seen else 0.0)
    total = sink + sum(weights)
    head = np.exp(np.asarray(head_logits, dtype=np.float64))
    law = np.zeros(vocab)
    law[np.asarray(columns)] = (1 - pointer.gain * (1 - sink / total)) * head / head.sum()
    for i, w in enumerate(weights):
        if w > 0:  # a hidden key brings nothing (its value may lie past the text)
            law[tokens[i + shift]] += pointer.gain * w / total
    return law


@settings(derandomize=True, max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 7), min_size=4, max_size=40), st.integers(1, 3), st.floats(0.5, 8.0),
       st.floats(-2.0, 10.0), st.floats(0.0, 1.0), st.floats(0.5, 2.0), st.sampled_from(UNMATCHED), st.data())
def test_the_law_is_the_docstrings_on_every_row_alone_and_together(tokens, order, scale, sink, gain, alpha, unmatched,
                                                                   data):
    pointer = CopyPointer(order, scale, sink, gain, unmatched)
    shift = data.draw(st.integers(1, 3))
    window = data.draw(st.one_of(st.none(), st.integers(1, 12)))
    sinks = data.draw(st.one_of(st.none(), st.integers(1, 3))) if window else None
    lo = data.draw(st.integers(0, len(tokens) - 3))
    hi = data.draw(st.integers(lo + 1, len(tokens) - 1))
    columns = torch.tensor([0, 2, 3, 5])
    head = torch.randn(hi - lo, 4, generator=torch.Generator().manual_seed(len(tokens)))
    rows = torch.arange(lo, hi)
    x = torch.tensor(tokens)
    together = pointer.mix(head, columns, x, rows, alpha, 8, window=window, sinks=sinks, shift=shift).exp()
    for r, t in enumerate(range(lo, hi)):  # each row alone and all together (chunks of rows) agree
        alone = pointer.mix(head[r:r + 1], columns, x, rows[r:r + 1], alpha, 8, window=window, sinks=sinks,
                            shift=shift).exp()
        expect = brute_law(pointer, head[r].double(), columns, tokens, t, alpha, 8, window, sinks, shift)
        # float32 laws of probabilities <= 1: a few float32 roundings of log and exp
        np.testing.assert_allclose(alone[0].double().numpy(), expect, rtol=0, atol=2e-6)
        np.testing.assert_allclose(together[r].double().numpy(), expect, rtol=0, atol=2e-6)


def test_gain_zero_is_the_head_alone_and_laws_sum_to_one():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, generator=g)
    tokens = [1, 2, 1, 2, 1, 2, 7]
    plain, columns = _mix(CopyPointer(2, 8.0, 4.0, 0.0), logits, tokens)
    expect = torch.full((6, 8), float("-inf"))
    expect[:, columns] = torch.log_softmax(logits, -1)
    torch.testing.assert_close(plain, expect, rtol=0, atol=1e-6)  # float32 log of a softmax
    mixed, _ = _mix(CopyPointer(2, 8.0, 4.0, 0.7), logits, tokens)
    torch.testing.assert_close(mixed.exp().sum(-1), torch.ones(6), rtol=0, atol=1e-6)


def test_a_repeat_is_copied_and_a_window_hides_it():
    """Row 4 knows ``.. 1, 2`` (tokens 4, 5), which ended at row 1, followed by 7: the pointer drafts 7,
    a token outside the head's draft vocabulary; a window of 2 keys hides row 1 and the head's law wins."""
    tokens = [1, 2, 7, 3, 1, 2, 4]
    logits = torch.zeros(6, 4)
    logits[:, 1] = 3.0  # the head alone drafts target id 2
    pointer = CopyPointer(2, 8.0, 12.0, 1.0)
    mixed, _ = _mix(pointer, logits, tokens)
    assert int(mixed[4].argmax()) == 7
    # match 16 against the sink's 12 and 4 rows that match nothing (logit 0 each)
    w = math.exp(16) / (math.exp(16) + math.exp(12) + 4)
    assert abs(float(mixed[4, 7].exp()) - w) < 1e-5
    windowed, _ = _mix(pointer, logits, tokens, window=2)
    assert int(windowed[4].argmax()) == 2


def test_alpha_scales_the_match_and_the_sink_alike():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(9, 4, generator=g)
    tokens = [1, 2, 3, 1, 2, 3, 1, 2, 1, 2]
    scaled, _ = _mix(CopyPointer(3, 2.0, 3.0, 0.9), logits, tokens, alpha=torch.full((9,), 1.5))
    direct, _ = _mix(CopyPointer(3, 3.0, 4.5, 0.9), logits, tokens)
    torch.testing.assert_close(scaled, direct, rtol=0, atol=1e-5)


def test_the_keeping_slope_holds_the_sinks_share_at_every_length():
    """Rows that match nothing (all tokens distinct): under the log-linear law with slope ``1 / sink`` the
    head keeps the same share at n = 64, 256 and 1,024 as at n_ref = 64 (float32 softmax: 1e-5); with
    no scale its share falls, so this test can fail."""
    from calibrate.drafters.pointer import alpha as pointer_alpha

    pointer = CopyPointer(2, 3.0, 6.0, 1.0)
    spec = ScaleSpec(law="log-linear", n_ref=64, slope=keeping_slope(pointer), top_k=2)
    tokens = torch.arange(1100)
    logits = torch.zeros(1, 4)
    columns = torch.arange(1096, 1100)  # no copied token among them
    shares = {}
    for n in (64, 256, 1024):
        for name, s in (("spec", spec), ("none", None)):
            law = pointer.mix(logits, columns, tokens, torch.tensor([n - 1]), pointer_alpha(s, n), 1100)
            shares[name, n] = float(law[0, columns].exp().sum())
    expect = 1 - 64 / (64 + math.exp(6.0))  # the head's share at n_ref
    assert all(abs(shares["spec", n] - expect) < 1e-5 for n in (64, 256, 1024))
    assert shares["none", 1024] < expect - 0.5
    with pytest.raises(ValueError, match="no keeping slope"):
        keeping_slope(CopyPointer(2, 3.0, 0.0, 1.0))


@pytest.mark.parametrize("unmatched", UNMATCHED)
def test_the_share_on_keys_that_match_nothing_grows_with_n_unless_they_are_masked(unmatched):
    """The mechanism behind the scale's win on a copying drafter: a scored pointer's rows that match nothing
    take ``U / (e^sink + U + sum e^{scale m})`` of its attention (float64 formula; float32 softmax: 1e-4), a
    share that grows toward 1 with the context; a masked pointer gives them nothing at any length."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 5000, (8200,), generator=g)  # random text: few chance matches
    pointer = CopyPointer(2, 8.0, 12.0, 1.0, unmatched)
    shares = []
    for n in (256, 1024, 8192):
        split = pointer.mass(tokens, torch.tensor([n - 1]))[0]  # sink, matched, unmatched
        assert abs(float(split.sum()) - 1) < 1e-4  # a float32 softmax over up to 8,193 logits, summed
        match = matches(tokens, n - 1, n, 2)[0].double()
        hits = match[match > 0]
        unmatched_keys = int((match == 0).sum()) if unmatched == "scored" else 0
        total = math.exp(12.0) + unmatched_keys + float(torch.exp(8.0 * hits).sum())
        assert abs(float(split[2]) - unmatched_keys / total) < 1e-4
        assert abs(float(split[0]) - math.exp(12.0) / total) < 1e-4
        shares.append(float(split[2]))
    if unmatched == "scored":
        assert shares[0] < shares[1] < shares[2] and shares[2] > 0.03  # 8,191 keys at e^0 against e^12 = 162,755
    else:
        assert shares == [0.0, 0.0, 0.0]


def test_a_masked_pointer_falls_back_to_the_head_where_nothing_matches():
    tokens = [1, 2, 3, 4, 5, 6, 7]
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(2))
    masked, columns = _mix(CopyPointer(2, 8.0, -5.0, 1.0, "masked"), logits, tokens)  # even a sink below 0
    expect = torch.full((6, 8), float("-inf"))
    expect[:, columns] = torch.log_softmax(logits, -1)
    torch.testing.assert_close(masked, expect, rtol=0, atol=1e-6)  # float32 log of a softmax
    scored, _ = _mix(CopyPointer(2, 8.0, -5.0, 1.0), logits, tokens)
    assert float((scored.exp() - expect.exp()).abs().max()) > 0.3  # the scored pointer's unmatched keys take mass


def test_a_masked_pointer_round_trips_and_a_scored_file_keeps_its_old_fields(tmp_path):
    masked = CopyPointer(3, 4.0, 8.0, 0.8, "masked")
    write(tmp_path / "m", masked)
    assert read(tmp_path / "m")[0] == masked
    write(tmp_path / "s", CopyPointer(3, 4.0, 8.0, 0.8))
    assert "unmatched" not in json.loads((tmp_path / "s" / FILE).read_text())  # files as before the option
    data = json.loads((tmp_path / "m" / FILE).read_text())
    (tmp_path / "m" / FILE).write_text(json.dumps({**data, "unmatched": "ignored"}))
    with pytest.raises(UserError, match="unmatched must be scored or masked, got 'ignored'"):
        read(tmp_path / "m")


@pytest.mark.parametrize("fields, what", [({"unmatched": "hidden"}, "unmatched"), ({"unmatched": None}, "unmatched"),
                                          ({"order": 0}, "order"), ({"order": 9}, "order"), ({"order": 1.5}, "order"),
                                          ({"scale": 0.0}, "scale"), ({"scale": float("nan")}, "scale"),
                                          ({"sink": float("inf")}, "sink"), ({"gain": 1.5}, "gain"),
                                          ({"gain": -0.1}, "gain"), ({"gain": True}, "gain")])
def test_bad_numbers_are_refused_by_name(fields, what):
    with pytest.raises(ValueError, match=what):
        CopyPointer(**fields)


def test_file_round_trip_and_bad_files(tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    pointer = CopyPointer(3, 4.0, 6.0, 0.8)
    path = write(tmp_path / "copy", pointer, head="../head", record={"note": "test"})
    assert read(tmp_path / "copy") == (pointer, head.resolve())
    assert read(head) is None
    bad = {
        "not json": "{", "an array": "[]", "another format": json.dumps({"format": "x", "version": 1}),
        "version 2": json.dumps({"format": "sharpdraft-copy-pointer", "version": 2}),
        "a bad gain": json.dumps({"format": "sharpdraft-copy-pointer", "version": 1, "gain": "all"}),
        "a missing head": json.dumps({"format": "sharpdraft-copy-pointer", "version": 1, "head": "../nowhere"}),
        "a head that is a number": json.dumps({"format": "sharpdraft-copy-pointer", "version": 1, "head": 3}),
    }
    for what, text in bad.items():
        path.write_text(text)
        with pytest.raises(UserError, match=FILE):
            read(tmp_path / "copy")
    write(head, pointer)  # the named head has a pointer of its own: refused, no chain of pointers
    path.write_text(json.dumps({"format": "sharpdraft-copy-pointer", "version": 1, "head": "../head"}))
    with pytest.raises(UserError, match="of its own"):
        read(tmp_path / "copy")
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(UserError, match="not a readable JSON"):
        read(tmp_path / "copy")


# -- an EAGLE-3 head with a pointer ----------------------------------------------------------------

POINTER = CopyPointer(2, 6.0, 9.0, 0.9)
SPEC = ScaleSpec(law="log-linear", n_ref=8, slope=0.5, top_k=2)


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    target = tiny_target(0)
    head = load_eagle3_head(write_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), target, seed=1), target)
    return Eagle3Adapter(head, target, None), Eagle3Adapter(head, target, None, pointer=POINTER)


def repeating_prompt(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(0, 256, (1, n // 2), generator=g)
    return torch.cat((half, half), dim=1)


@pytest.mark.parametrize("spec", [None, SPEC], ids=["plain", "spec"])
def test_the_chain_drafts_what_teacher_forcing_measures(drafters, spec):
    """The chain drafter's first law after a prompt is teacher-forced row ``N - 1``'s mixed law."""
    _, drafter = drafters
    ids = repeating_prompt(40, 0)
    forced = drafter.teacher_forced(ids, [(spec, None)])
    shared = prefill(drafter.target, ids[:, :-1], drafter.feature_ids)
    chain = drafter.proposer(spec)
    with torch.no_grad():
        chain.start(ids[:, :-1], shared.features, int(ids[0, -1]))
        assert chain.propose(1, GREEDY)[0] == [int(forced.drafted[0, -1])]


def test_the_pointer_copies_what_the_head_alone_does_not(drafters):
    plain, pointed = drafters
    ids = repeating_prompt(60, 1)
    a = plain.teacher_forced(ids, [(None, None)])
    b = pointed.teacher_forced(ids, [(None, None)])
    second = slice(31, 58)  # rows inside the repeat, where the target's greedy token is often the copy
    truth = ids[0, 2:]  # row t drafts token t + 2
    copied_plain = float((a.drafted[0, second] == truth[second]).float().mean())
    copied = float((b.drafted[0, second] == truth[second]).float().mean())
    assert copied > 0.9 and copied > copied_plain + 0.5


def test_a_pointer_folder_loads_its_head(tmp_path, monkeypatch):
    """``--drafter-path`` a folder with only copy_pointer.json: the head it names is loaded, with the pointer."""
    target = tiny_target(0)
    head_dir = write_tiny_eagle3(tmp_path / "head", target, seed=1)
    write(tmp_path / "copy", POINTER, head="../head")
    import calibrate.drafters.eagle3 as eagle3

    monkeypatch.setattr(eagle3, "load_target", lambda path, device, dtype: (target, None))
    drafter = load("eagle3", str(tmp_path / "copy"), None, "cpu", torch.float32)
    assert drafter.pointer == POINTER and any("copy pointer" in note for note in drafter.notes)
    assert load("eagle3", str(head_dir), None, "cpu", torch.float32).pointer is None


def test_pointer_unmatched_masks_the_loaded_pointer_as_a_masked_file_would(tmp_path, monkeypatch):
    """``--pointer-unmatched masked`` (``load_drafter(..., pointer_unmatched=)``) on a scored pointer's folder: the
    pointer's other numbers kept, its notes saying so, and the forced pass that of an adapter built with the masked
    pointer; it differs from the scored pointer's (its unmatched keys no longer take mass)."""
    from dataclasses import replace

    import calibrate.drafters.eagle3 as eagle3
    from calibrate.drafters import load_drafter

    target = tiny_target(0)
    write_tiny_eagle3(tmp_path / "head", target, seed=1)
    write(tmp_path / "copy", POINTER, head="../head")
    monkeypatch.setattr(eagle3, "load_target", lambda path, device, dtype: (target, None))
    scored = load_drafter("eagle3", str(tmp_path / "copy"), None, "cpu", torch.float32)
    masked = load_drafter("eagle3", str(tmp_path / "copy"), None, "cpu", torch.float32, pointer_unmatched="masked")
    assert masked.pointer == replace(POINTER, unmatched="masked") and scored.pointer == POINTER
    assert any("rows matching nothing masked" in note for note in masked.notes)
    assert not any("masked" in note for note in scored.notes)
    built = Eagle3Adapter(masked.head, target, None, pointer=replace(POINTER, unmatched="masked"))
    ids = repeating_prompt(40, 2)
    got, expect = masked.teacher_forced(ids, [(SPEC, None)]), built.teacher_forced(ids, [(SPEC, None)])
    torch.testing.assert_close(got.accept, expect.accept, rtol=0, atol=0)  # the same computation
    assert not torch.equal(got.accept, scored.teacher_forced(ids, [(SPEC, None)]).accept)
    again = load_drafter("eagle3", str(tmp_path / "copy"), None, "cpu", torch.float32, pointer_unmatched="scored")
    assert again.pointer == POINTER  # scored on a scored file: as it was


def test_pointer_unmatched_enters_the_resume_key_only_when_given():
    from calibrate.bench import BenchOptions
    from calibrate.eval.options import EvalOptions

    assert "pointer_unmatched" not in EvalOptions().to_dict()
    assert "pointer_unmatched" not in BenchOptions(out="o.json").to_dict()
    copy = "calibrate/assets/eagle3-smollm2-copy"
    assert EvalOptions(drafter_path=copy, pointer_unmatched="masked").to_dict()["pointer_unmatched"] == "masked"
    assert BenchOptions(out="o.json", drafter_path=copy, pointer_unmatched="masked").to_dict()["pointer_unmatched"] \
        == "masked"


def test_eval_runs_every_arm_on_a_pointer_head(drafters, tmp_path):
    """``evaluate`` with a pointer head on text that repeats: every arm measured, every speculative output
    equal to target-only greedy, the pointer recorded. (The random target does not copy, so agreement
    is not compared here; ``test_the_pointer_copies_what_the_head_alone_does_not`` compares copies.)"""
    from calibrate.eval.options import EvalOptions
    from calibrate.eval.run import evaluate

    from test_eval import LENGTHS, ByteTokenizer

    plain, pointed = drafters
    passage = "the query meets its key and the mass follows; " * 2
    corpus = tmp_path / "text.txt"
    corpus.write_text((passage + "a drafter copies what it saw. ") * 12)
    results = []
    for drafter in (plain, pointed):
        drafter.tokenizer = ByteTokenizer()
        results.append(evaluate(drafter, EvalOptions(spec=SPEC, lengths=LENGTHS, corpus=str(corpus), sequences=2,
                                                     rows_per_bucket=8, speculative=True, new_tokens=8, num_draft=3,
                                                     variants=["none", "spec", "window", "lookup+head"], window=16)))
    for r in results:
        assert r["speculative"]["outputs_identical"] is True
        assert all(0 <= row[v]["agreement"] <= 1 for row in r["buckets"] for v in ("none", "spec", "window"))
    assert "copy_pointer" not in results[0]["drafter"]
    assert results[1]["drafter"]["copy_pointer"] == {"order": 2, "scale": 6.0, "sink": 9.0, "gain": 0.9}


# -- blocks: row j copies the token j places after a match ------------------------------------------

def test_block_rows_copy_further_along_the_source():
    """Known text ``5 6 7 8 9 4 5 6``: the suffix ``5 6`` ended at position 1, so row j copies x_{1+j}:
    7, 8, 9; a key whose source lies past the known text takes no part."""
    from calibrate.drafters.pointer import block_mix

    tokens = torch.tensor([5, 6, 7, 8, 9, 4, 5, 6])
    logits = torch.zeros(7, 12)
    mixed = block_mix(CopyPointer(2, 8.0, 4.0, 1.0), logits, tokens, 1.0)
    assert mixed[:3].argmax(-1).tolist() == [7, 8, 9]
    assert mixed[5].argmax(-1).tolist() == 6  # x_{1+6} = 6, the last known token
    # row 7: the match's x_{1+7} is unknown, so only key 0 (x_7 = 6 known, matching nothing: logit 0) takes
    # part beside the sink (4); were key 1 there (match 2, logit 16) it would take almost all
    w = 1 / (1 + math.exp(4.0))
    expect = torch.full((12,), (1 - w) / 12)
    expect[6] += w
    torch.testing.assert_close(mixed[6].exp(), expect, rtol=0, atol=1e-6)
    alone = block_mix(CopyPointer(2, 8.0, 4.0, 1.0), logits[:2], tokens[:1], 1.0)  # nothing before x_0
    torch.testing.assert_close(alone, torch.log_softmax(logits[:2], -1))


@pytest.fixture(scope="module")
def dflash(tmp_path_factory):
    from calibrate.drafters.dflash import DFlashAdapter, load_dflash

    from tiny_checkpoints import write_tiny_dflash

    target = tiny_target(0)
    model = load_dflash(write_tiny_dflash(tmp_path_factory.mktemp("dflash"), target, seed=2, block_size=4), target)
    return DFlashAdapter(model, target, None), DFlashAdapter(model, target, None, pointer=POINTER)


@pytest.mark.parametrize("spec", [None, SPEC, ScaleSpec(law="constant", n_ref=None, slope=0.0, top_k=2, window=8)],
                         ids=["plain", "spec", "window"])
def test_dflash_with_a_pointer_forces_as_it_drafts(dflash, spec):
    """The teacher-forced guess of x_{p+1} is the pointed block's row 1 after x_p; on a repeat it copies
    (decoding is held to the target in tests/test_conformance.py)."""
    from calibrate.drafters.target import hidden_state_features

    plain, pointed = dflash
    prompt = repeating_prompt(24, 4)
    forced = pointed.teacher_forced(prompt, [(spec, None)])
    feats = hidden_state_features(pointed.target, prompt, pointed.model.config.hidden_state_ids)
    for p in (0, 5, 17):
        chain = pointed.proposer(spec)
        chain.start(prompt[:, :p], feats[:, :p], int(prompt[0, p]))
        assert int(chain.draft_logits(1)[0].argmax()) == int(forced.drafted[0, p])
    copies = float((forced.drafted[0, 12:23] == prompt[0, 13:24]).float().mean())  # the repeat: copy the next
    if spec is not None and spec.window is not None:
        assert copies < 0.5  # a window of 8 hides the source 12 tokens back
        return
    assert copies > 0.9
    assert float((plain.teacher_forced(prompt, [(spec, None)]).drafted[0, 12:23] == prompt[0, 13:24]).float().mean()) < 0.5


@pytest.mark.parametrize("spec", [None, SPEC], ids=["plain", "spec"])
def test_pard_with_a_pointer_drafts_once_a_step_and_forces_as_it_drafts(spec):
    """PARD's K drafts from one forward, each row with its copies: one drafter forward per verification;
    the teacher-forced guess of x_{t+1} is the drafter's row 0 after x_t; on a repeat it copies."""
    from calibrate.drafters.hf import CausalLMAdapter
    from calibrate.drafters.parallel import PardParallelProposer
    from calibrate.drafters.pointer import with_pointer

    target, model = tiny_target(0), tiny_target(5, num_layers=2)
    prompt = repeating_prompt(24, 5)
    drafter = PardParallelProposer(model, 250, spec)
    out = speculative_generate(target, with_pointer(drafter, POINTER, spec), prompt, 16, 4)
    assert drafter.forwards == out.steps
    from test_eval import ByteTokenizer

    adapter = CausalLMAdapter(model, ByteTokenizer(), kind="pard", path=None, default_n_ref=8, target=target,
                              pointer=POINTER)
    forced = adapter.teacher_forced(prompt, [(spec, None)])
    for p in (3, 13, 20):
        chain = with_pointer(PardParallelProposer(model, 250, spec), POINTER, spec)
        chain.start(prompt[:, :p], None, int(prompt[0, p]))
        assert int(chain.draft_logits(1)[0].argmax()) == int(forced.drafted[0, p])
    assert float((forced.drafted[0, 12:23] == prompt[0, 13:24]).float().mean()) > 0.9


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "pard"])
def test_the_built_in_default_is_the_head_with_its_copy_pointer(kind):
    """Without --drafter-path a built-in kind loads its SmolLM2 head with the copy pointer fitted for it; the head
    alone stays loadable by name, and a path given is used as is."""
    from calibrate.drafters import ASSETS, default_drafter_path
    from calibrate.drafters.pointer import locate

    default = default_drafter_path(kind, None)
    pointer, head = locate(default)
    assert pointer is not None and head == (ASSETS / f"{kind}-smollm2").resolve()
    assert locate(head)[0] is None  # the head alone: no pointer
    assert default_drafter_path(kind, "some/folder") == "some/folder"


def test_a_kind_without_a_built_in_pointer_keeps_its_adapters_default():
    from calibrate.drafters import default_drafter_path

    assert default_drafter_path("hf", None) is None


@pytest.mark.parametrize("unmatched", UNMATCHED)
def test_a_teacher_forced_arm_forms_its_law_over_the_head_columns_and_the_texts_tokens(unmatched):
    """``PointerArm`` over a head with a draft vocabulary gives its rows over the union of the head's columns and
    the text's tokens only: put back in the whole vocabulary they are the whole-vocabulary mix (float64 rounding
    of float32 log laws: 1e-5), and the columns left out are exactly those where that law is 0."""
    from dataclasses import dataclass

    from calibrate.drafters.base import ForcedRows
    from calibrate.drafters.pointer import PointerArm

    vocab, rows = 300, 40
    gen = torch.Generator().manual_seed(3)
    head_columns = torch.randperm(vocab, generator=gen)[:50].sort().values
    tokens = torch.randint(0, vocab, (rows + 2,), generator=gen)
    tokens[20:30] = tokens[5:15]  # a repeat to copy
    logits = torch.randn(rows, len(head_columns), generator=gen)
    positions = torch.arange(rows) + 1

    @dataclass
    class Arm:
        columns = head_columns

        def __call__(self, spec, tap):
            yield ForcedRows(torch.arange(rows), logits, positions, positions + 1, positions + 1, head_columns)

    pointer = CopyPointer(2, 4.0, 4.0, 0.8, unmatched)
    arm = PointerArm(Arm(), pointer, tokens, vocab)
    (part,) = arm(None, None)
    assert torch.equal(part.columns, torch.unique(torch.cat((head_columns, tokens)))) and len(part.columns) < vocab
    whole = pointer.mix(logits, head_columns, tokens, positions - 1, 1.0, vocab)
    placed = torch.full((rows, vocab), float("-inf"))
    placed[:, part.columns] = part.logits
    finite = torch.isfinite(whole)
    assert torch.equal(finite, torch.isfinite(placed))
    assert float((whole[finite].double() - placed[finite].double()).abs().max()) < 1e-5
    assert torch.equal(part.drafted(), whole.argmax(-1))


def test_a_resumed_run_keys_on_the_drafter_as_loaded(tmp_path):
    """eval's and bench's resume keys record the built-in default's folder, not an absent --drafter-path: a run
    saved when the default was another drafter does not resume with this one (calibrate's key takes the same
    call in ``calibrate.run._prepare``)."""
    from calibrate.bench import BenchOptions
    from calibrate.drafters import default_drafter_path
    from calibrate.eval.options import EvalOptions

    default = default_drafter_path("eagle3", None)
    assert EvalOptions(drafter="eagle3").to_dict()["drafter_path"] == default
    assert BenchOptions(out=tmp_path / "b.json").to_dict()["drafter_path"] == default
    named = "calibrate/assets/eagle3-smollm2"
    assert EvalOptions(drafter="eagle3", drafter_path=named).to_dict()["drafter_path"] == named
