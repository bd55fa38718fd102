"""``sharpdraft eval`` on a recall corpus (``--corpus recall:SOURCE``): copy agreement, the target's
accuracy and prompt lookup, held to the adapter's own outputs and to float64 sums written here."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.corpus import documents, pack, recall_corpus
from calibrate.errors import UserError
from calibrate.eval.options import EvalOptions
from calibrate.eval.run import evaluate
from calibrate.lookup import LookupSettings, next_token_drafts
from calibrate.measure import Arm, tally_sequence
from calibrate.recall import usable_distances

from test_eval import LENGTHS, SPEC, ByteTokenizer, _check_fits_80_columns, corpus, eagle3  # noqa: F401 (fixtures)
from tiny_checkpoints import tiny_target, write_tiny_eagle3

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)

TOK = ByteTokenizer()


def _recall(corpus: str, length: int = 128, limit=None):
    return recall_corpus("recall:" + corpus, TOK.encode, TOK.eos_token_id, length, limit)


def test_recall_sequences_come_from_the_sources_joined_text(corpus):
    made = _recall(corpus, 128, 2)
    stream = [t for doc in documents(corpus) for t in TOK.encode(doc)]  # one document: nothing to join
    assert made[0].ids[:made[0].distance] == stream[:made[0].distance]
    assert [m.ids for m in made] == list(pack("recall:" + corpus, TOK.encode, TOK.eos_token_id, 128, 2))
    assert [m.ids for m in made] == [m.ids for m in _recall(corpus, 128, 2)]  # deterministic
    everything = _recall(corpus, 128)
    assert len(everything) > 2 and [m.ids for m in everything[:2]] == [m.ids for m in made]


@pytest.mark.parametrize("source, match", [("recall:", "recall:SOURCE"), ("recall:recall:pydoc", "recall:SOURCE")])
def test_recall_refusals(source, match):
    with pytest.raises(UserError, match=match):
        recall_corpus(source, TOK.encode, 0, 128)


def test_recall_refuses_too_short_sequences(corpus):
    with pytest.raises(UserError, match="fits sequences of 64"):
        _recall(corpus, 64)


def test_recall_at_named_distances_takes_them_in_turn_from_the_same_text(corpus):
    """``recall@D1,D2:SOURCE`` builds sequences at those distances only, in the order given, from the same
    stream as ``recall:SOURCE`` (so a run can ask for the far repeats without skipping the near ones)."""
    made = recall_corpus(f"recall@64,40:{corpus}", TOK.encode, TOK.eos_token_id, 128, 3)
    assert [m.distance for m in made] == [64, 40, 64]  # this test can fail: the defaults start at 48
    for m in made:
        t = np.flatnonzero(m.copied)
        assert len(t) and all(m.ids[i] == m.ids[i - m.distance] for i in t)
    default = _recall(corpus, 128, 1)[0]
    assert made[0].ids[:10] == default.ids[:10]  # the same text, laid out at another distance


@pytest.mark.parametrize("source, match", [
    ("recall@:x", "repeat distance ''"), ("recall@12:x", "repeat distance '12'"), ("recall@1_0:x", "'1_0'"),
    ("recall@-48:x", "'-48'"), ("recall@48.5:x", "'48.5'"), ("recall@2000000:x", "'2000000'"),
    ("recall@48,48:x", "given twice"), ("recall@48", "recall@D1,D2"), ("recall@48:", "recall:SOURCE"),
    ("recall@48:recall:pydoc", "recall:SOURCE")])
def test_recall_at_refusals(source, match):
    with pytest.raises(UserError, match=re.escape(match)):
        recall_corpus(source, TOK.encode, 0, 128)


def test_tally_on_a_recall_sequence_by_hand(eagle3, corpus):
    """Each recall sum is the adapter's rows, counted by hand over the mask: EAGLE-3's row t guesses
    token t + 2; lookup's acceptance is p_T(draft), a float64 softmax of the target's logits."""
    seq = _recall(corpus, 128, 1)[0]
    ids = torch.tensor([seq.ids])
    edges = np.array(LENGTHS)
    arms = [Arm("none"), Arm("lookup", drafts="lookup"), Arm("lookup+head", drafts="lookup+head")]
    tally = tally_sequence(eagle3, ids, arms, edges, top_k=2, temperature=0.7, rows_per_bucket=8, copied=seq.copied)
    forced = eagle3.teacher_forced(ids, [(None, None)], temperature=0.7)
    R = forced.target_next.shape[0]
    assert R == len(seq.ids) - 1 and eagle3.predicts == 2
    guessed = np.arange(R) + 2
    copy = np.r_[seq.copied, False][guessed]
    other = (guessed < len(seq.ids)) & ~copy
    assert copy.sum() > 0 and other.sum() > 0
    bucket = np.searchsorted(edges, np.arange(1, R + 1))
    target_next = forced.target_next.numpy()
    truth = np.r_[seq.ids, -1][guessed]
    with torch.no_grad():
        logits = eagle3.target(ids).logits[0, 1:].double()  # (R, vocab): the target after position t + 1
    p = torch.softmax(logits / 0.7, -1).numpy()
    looked = next_token_drafts(seq.ids, LookupSettings(eos_token_id=0))[2:]  # (R,)
    found = looked >= 0
    look_hit = found & (looked == target_next)
    look_accept = np.where(found, p[np.arange(R), np.maximum(looked, 0)], 0.0)
    head_hit = (forced.drafted[0] == forced.target_next).numpy()
    head_accept = forced.accept[0].double().numpy()
    for b in range(len(edges)):
        for name, mask in (("copy", copy), ("other", other)):
            rows = (bucket == b) & mask
            assert tally.subsets[name][b] == rows.sum()
            assert tally.sums["target"][f"{name}_accuracy"][b] == (target_next == truth)[rows].sum()
            assert tally.sums["none"][f"{name}_agreement"][b] == head_hit[rows].sum()
            assert tally.sums["lookup"][f"{name}_agreement"][b] == look_hit[rows].sum()
            # float32 softmax over 256 logits against float64: 1e-5 per row, summed over <= 64 rows
            assert tally.sums["lookup"][f"{name}_expected_acceptance"][b] == pytest.approx(
                look_accept[rows].sum(), abs=1e-4)
            both = np.where(found, look_accept, head_accept)
            assert tally.sums["lookup+head"][f"{name}_expected_acceptance"][b] == pytest.approx(
                both[rows].sum(), abs=1e-4)
        assert tally.sums["lookup"]["agreement"][b] == look_hit[bucket == b].sum()
    assert tally.mass["lookup"].sum() == 0 and tally.mass["none"].sum() > 0


@pytest.fixture(scope="module")
def recall_result(eagle3, corpus):
    return evaluate(eagle3, EvalOptions(spec=SPEC, lengths=LENGTHS, corpus="recall:" + corpus, sequences=2,
                                        rows_per_bucket=8, variants=("none", "spec", "lookup+head"), speculative=True,
                                        new_tokens=6, num_draft=3))


def test_recall_result(recall_result):
    r = recall_result
    assert list(r["variants"]) == ["none", "spec", "lookup+head", "lookup"]  # lookup joins on a recall corpus
    assert r["recall"] == {"distances": usable_distances(128) * 2} and r["lookup"] == {"max_ngram": 2, "min_ngram": 1}
    assert r["speculative"]["outputs_identical"] is True
    assert r["speculative"]["drafters"] == {"none": "eagle3", "spec": "eagle3", "lookup+head": "lookup+eagle3",
                                            "lookup": "lookup"}
    for row in r["buckets"]:
        copy, other = np.array(row["copy_rows_per_sequence"]), np.array(row["other_rows_per_sequence"])
        assert np.all(copy + other <= np.array(row["rows_per_sequence"]))
        for variant in r["variants"]:
            cell = row[variant]
            for metric, rows in (("copy_agreement", copy), ("other_agreement", other),
                                 ("copy_expected_acceptance", copy)):
                assert len(cell["per_sequence"][metric]) == 2
                assert 0 <= cell[metric] <= 1 if rows.sum() else cell[metric] is None  # no copy before n = 49
            if variant != "none" and copy.sum():
                mean, lo, hi = cell["delta_vs_none"]["copy_agreement"]
                assert lo <= mean <= hi
        if copy.sum():
            pooled = np.array(row["none"]["per_sequence"]["copy_agreement"]).sum() / copy.sum()
            assert row["none"]["copy_agreement"] == pytest.approx(pooled, abs=1e-4)
        assert set(row["target"]) >= {"copy_accuracy", "other_accuracy", "copy_accuracy_interval"}
        assert row["lookup"]["mass"] is None
    json.dumps(r)


def test_other_corpora_show_no_copy_metrics(eagle3, corpus):
    r = evaluate(eagle3, EvalOptions(spec=SPEC, lengths=LENGTHS, corpus=corpus, sequences=1, rows_per_bucket=8,
                                     variants=("none", "lookup")))
    assert r["recall"] is None and "target" not in r["buckets"][0]
    assert not any(k.startswith(("copy", "other")) for k in r["buckets"][0]["none"])
    assert 0 <= r["buckets"][0]["lookup"]["agreement"] <= 1


def test_recall_summary_at_80_columns(recall_result, monkeypatch, capsys):
    from calibrate.eval.report import print_summary

    monkeypatch.setenv("COLUMNS", "80")
    print_summary(recall_result)
    out = capsys.readouterr().out
    _check_fits_80_columns(out, [*recall_result["variants"], "target"],
                           ["copy_agreement", "other_agreement", "copy_accuracy", "other_accuracy"])


def test_cli_resume_on_a_recall_corpus_and_refusal_of_another_corpus(tmp_path, monkeypatch):
    """An interrupted recall run resumes to the same result; its partial is refused for another corpus."""
    from test_calibrate import _write_tokenizer

    from calibrate.measure import SavedUnits

    target = tiny_target(0)
    target.save_pretrained(tmp_path / "target")
    _write_tokenizer(tmp_path / "target")
    write_tiny_eagle3(tmp_path / "eagle3", target, seed=1)
    (tmp_path / "c.txt").write_text(" ".join(["the query sees more keys as the context grows"] * 40))
    base = ["eval", "--drafter-path", str(tmp_path / "eagle3"), "--target-path", str(tmp_path / "target"),
            "--lengths", "64,128", "--sequences", "2", "--device", "cpu", "--json"]
    args = base + ["--corpus", f"recall:{tmp_path / 'c.txt'}"]
    whole = CliRunner().invoke(app, args + ["--out", str(tmp_path / "whole.json")])
    assert whole.exit_code == 0, whole.output
    monkeypatch.setattr(SavedUnits, "finish", lambda self: None)  # the run "stops" before its partial is removed
    first = CliRunner().invoke(app, args + ["--out", str(tmp_path / "r.json")])
    assert first.exit_code == 0, first.output
    assert (tmp_path / "r.json.partial" / "forced-00001.json").is_file()
    resumed = CliRunner().invoke(app, args + ["--out", str(tmp_path / "r.json"), "--resume"])
    assert resumed.exit_code == 0, resumed.output
    strip = lambda text: {k: v for k, v in json.loads(text).items() if k != "spec_file"}  # noqa: E731
    assert strip(resumed.stdout)["buckets"] == strip(whole.stdout)["buckets"]
    other = CliRunner().invoke(app, base + ["--corpus", str(tmp_path / "c.txt"), "--out", str(tmp_path / "r.json"),
                                            "--resume"])
    assert isinstance(other.exception, UserError) and "--resume: corpus does not match" in str(other.exception)


def test_eval_table_pairs_copy_agreement_over_the_copied_rows(recall_result):
    """calibrate.eval.tables (scripts/eval_table.py) gives back eval's copy and other deltas (the same bootstrap over the subset's
    rows), and its tables name the copied rows and the target without a target column among the variants."""
    from calibrate.eval import tables as table

    for row in recall_result["buckets"]:
        if not sum(row["copy_rows_per_sequence"]):
            continue
        for variant in ("spec", "lookup", "lookup+head"):
            for metric in ("copy_agreement", "other_agreement"):
                assert table.contrast(row, variant, "none", metric) == pytest.approx(
                    row[variant]["delta_vs_none"][metric], abs=5e-5)  # 4 digits kept in the JSON
    text = table.tables(recall_result)
    assert "agreement on copied tokens" in text and "the target's own accuracy" in text and "| target |" not in text
    assert "copy agreement - lookup" in table.table_at(recall_result, LENGTHS[-1], ["lookup"])


def test_online_arms_report_copy_agreement_on_a_recall_corpus(eagle3, corpus):
    """An online arm's rows fall into the same copy and other subsets as the shared pass's: in the first
    chunk (rows 0 .. 63, scored before any update) its sums over every subset are none's exactly, and
    later its copy and other sums add up to no more than its whole."""
    from calibrate.online import OnlineOptions

    with torch.no_grad():  # as eval runs it: the online arms turn gradients on for their own steps only
        r = evaluate(eagle3, EvalOptions(spec=SPEC, lengths=(64, 128), corpus="recall:" + corpus, sequences=2,
                                         rows_per_bucket=8, variants=("none", "online-full"), online_every=64,
                                         online_lr=1e-2))
    first, later = r["buckets"]
    for metric in ("agreement", "copy_agreement", "other_agreement", "copy_expected_acceptance"):
        assert first["online-full"]["per_sequence"][metric] == pytest.approx(first["none"]["per_sequence"][metric],
                                                                            abs=1e-9)
    cell = later["online-full"]["per_sequence"]
    assert np.all(np.add(cell["copy_agreement"], cell["other_agreement"]) <= np.add(cell["agreement"], 1e-9))
    assert 0 <= later["online-full"]["copy_agreement"] <= 1
