"""``sharpdraft eval`` on tiny random drafters: structure, no change at n <= n_ref, exact mass scaling."""

from __future__ import annotations

import copy

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.drafters.eagle3 import Eagle3Adapter, load_eagle3_head
from calibrate.drafters.hf import CausalLMAdapter
from calibrate.errors import UserError
from calibrate.eval import tables
from calibrate.eval.options import EvalOptions
from calibrate.eval.run import evaluate
from calibrate.eval.variants import DEFAULT_VARIANTS, POSITION_VARIANTS, bucket_edges, default_spec
from calibrate.plots.eval import plot_result
from calibrate.measure import MassMeter
from calibrate.taps import ScalingTap
from sharpdraft_theory import ScaleSpec
from sharpdraft_theory.bootstrap import paired_bootstrap

from tiny_checkpoints import tiny_target, write_tiny_eagle3

LENGTHS = [32, 64, 128]  # the tiny head's n_ref is 64


class ByteTokenizer:
    """Bytes as token ids (vocabulary 256), 0 as end of sequence."""

    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return [b or 1 for b in text.encode()]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": self.encode(text)}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (conftest.py)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = random.Random(0)
    words = ["query", "key", "mass", "attention", "drafter", "token", "the", "of", "a", "long", "context"]
    path = tmp_path_factory.mktemp("corpus") / "heldout.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(200)))
    return str(path)


@pytest.fixture(scope="module")
def eagle3(tmp_path_factory):
    target = tiny_target(0)
    head = load_eagle3_head(write_tiny_eagle3(tmp_path_factory.mktemp("eagle3"), target, seed=1), target)
    return Eagle3Adapter(head, target, ByteTokenizer())


SPEC = ScaleSpec(law="log-linear", n_ref=64, slope=0.5, top_k=2)


@pytest.fixture(scope="module")
def eagle3_result(eagle3, corpus):
    return evaluate(eagle3, EvalOptions(spec=SPEC, lengths=LENGTHS, corpus=corpus, sequences=2, rows_per_bucket=16,
                                        speculative=True, new_tokens=8, num_draft=3))


def test_eagle3_result_shape(eagle3_result):
    r = eagle3_result
    assert [b["n"] for b in r["buckets"]] == LENGTHS
    assert r["speculative"]["outputs_identical"] is True and r["speculative"]["loop"] == "sharpdraft-chain"
    assert r["drafter"]["n_ref"] == 64
    assert list(r["variants"]) == list(DEFAULT_VARIANTS)
    assert r["variants"]["window"]["window"] == 64 and r["variants"]["sinks"] == {
        "law": "constant", "n_ref": None, "slope": 0.0, "window": 60, "sinks": 4, "positions": None}
    for row in r["buckets"]:
        for variant in DEFAULT_VARIANTS:
            cell = row[variant]
            assert 0 < cell["mass"] <= 1 and 0 <= cell["agreement"] <= 1
            assert 1 <= cell["acceptance_length"] <= 4 and cell["speedup"] > 0
            # the drafter's share of the decode time: a part of it, never all (the target verifies too)
            assert 0 < cell["draft_share"] < 1 and cell["draft_ms_per_round"] > 0
            lo, hi = cell["agreement_interval"]
            assert lo <= cell["agreement"] <= hi
            if variant != "none":
                for metric in ("agreement", "acceptance_length"):
                    mean, lo, hi = cell["delta_vs_none"][metric]
                    assert lo <= mean <= hi
    json.dumps(r)  # JSON-ready


def test_per_sequence_sums_pair_any_two_variants(eagle3_result):
    """The per-sequence sums eval keeps give back every mean and every difference from none it reports
    (so eval_table's pairing against any other variant is the same statistic), and pair two variants."""
    table = tables
    for row in eagle3_result["buckets"]:
        rows = np.asarray(row["rows_per_sequence"])
        assert rows.sum() == row["rows"] and rows.size == 2
        for variant in DEFAULT_VARIANTS:
            cell = row[variant]
            for metric in ("agreement", "expected_acceptance"):
                assert sum(cell["per_sequence"][metric]) / row["rows"] == pytest.approx(cell[metric], abs=5e-5)
            assert np.mean(cell["per_sequence"]["acceptance_length"]) == pytest.approx(cell["acceptance_length"],
                                                                                       abs=5e-5)
            if variant != "none":
                for metric in ("agreement", "expected_acceptance", "acceptance_length"):
                    assert table.contrast(row, variant, "none", metric) == pytest.approx(
                        cell["delta_vs_none"][metric], abs=5e-5)  # 4 digits kept in the JSON
        # pairing is antisymmetric and a variant against itself is exactly 0
        ab = table.contrast(row, "spec", "window", "agreement")
        ba = table.contrast(row, "window", "spec", "agreement")
        assert ab[0] == pytest.approx(-ba[0], abs=1e-12) and table.contrast(row, "spec", "spec", "agreement")[0] == 0
    text = table.table_at(eagle3_result, LENGTHS[-1], ["window"])
    assert "| spec |" in text and "agreement - window" in text
    with pytest.raises(SystemExit, match="--versus nope"):
        table.table_at(eagle3_result, LENGTHS[-1], ["nope"])
    with pytest.raises(SystemExit, match="--by-output: this eval has no output bins"):  # not a generated corpus
        table.output_table(eagle3_result)


def test_two_evals_of_the_same_prompts_pair_by_sequence(eagle3_result):
    """eval_table --against: one drafter's cells against another's on the same rows; a copy with one more hit per
    sequence in every bucket differs by exactly sequences / rows, with an interval; other prompts are refused."""
    table = tables
    other = copy.deepcopy(eagle3_result)
    for row in other["buckets"]:
        hits = row["none"]["per_sequence"]["agreement"]
        row["none"]["per_sequence"]["agreement"] = [h - 1 for h in hits]
        row["none"]["agreement"] = sum(hits) / row["rows"] - len(hits) / row["rows"]
    last = eagle3_result["buckets"][-1]
    got = table.contrast(last, "none", "none", "agreement", other["buckets"][-1])
    assert got[0] == pytest.approx(2 / last["rows"], rel=1e-12) and got[1] == got[2] == got[0]  # the same every resample
    text = table.table_against(eagle3_result, other, ("mine", "theirs"))
    assert "agreement mine - theirs" in text and f"| {last['n']} | spec |" in text
    assert table.contrast(last, "spec", "spec", "agreement", other["buckets"][-1])[0] == 0
    fewer = copy.deepcopy(other)
    fewer["sequences"] = 1
    with pytest.raises(SystemExit, match="--against: sequences 1 there, 2 here"):
        table.table_against(eagle3_result, fewer, ("mine", "theirs"))
    fewer = copy.deepcopy(other)
    fewer["buckets"] = fewer["buckets"][:1]
    with pytest.raises(SystemExit, match="--against: its buckets differ from these"):
        table.table_against(eagle3_result, fewer, ("mine", "theirs"))


def test_the_copy_pointer_control_pairs_the_scaled_pointer_with_the_masked_one(eagle3_result):
    """eval_table --control: the scored pointer's eval against the same with --pointer-unmatched masked. A masked
    eval with one hit fewer a sequence for none gives masking alone exactly sequences / rows, the across-run
    contrast is spec here minus none there, and evals that are not that pair are refused in one line."""
    table = tables
    scored = copy.deepcopy(eagle3_result)
    scored["drafter"]["copy_pointer"] = {"order": 3, "scale": 4.0, "sink": 8.0, "gain": 0.8}
    masked = copy.deepcopy(scored)
    masked["drafter"]["copy_pointer"]["unmatched"] = "masked"
    for row in masked["buckets"]:
        row["none"]["per_sequence"]["agreement"] = [h - 1 for h in row["none"]["per_sequence"]["agreement"]]
    text = table.table_control(scored, masked)
    last, there = scored["buckets"][-1], masked["buckets"][-1]
    alone = table.contrast(last, "none", "none", "agreement", there)
    assert alone[0] == pytest.approx(2 / last["rows"], rel=1e-12)
    across = table.contrast(last, "spec", "none", "agreement", there)
    assert across[0] == pytest.approx(table.contrast(last, "spec", "none", "agreement")[0] + 2 / last["rows"], rel=1e-9)
    lines = [line for line in text.splitlines() if line.startswith(f"| {last['n']} |")]
    assert [line.split(" | ")[1] for line in lines] == ["scored pointer: spec - none", "masked pointer: spec - none",
                                                        "**scored + spec - masked, none**", "scored, none - masked, none"]
    assert f"{alone[0]:+.3f}" in lines[3]
    with pytest.raises(SystemExit, match="this eval's pointer is masked and the other's scored"):
        table.table_control(masked, scored)
    other = copy.deepcopy(masked)
    other["drafter"]["copy_pointer"]["gain"] = 0.5
    with pytest.raises(SystemExit, match="the pointers' numbers differ"):
        table.table_control(scored, other)
    with pytest.raises(SystemExit, match="records no copy_pointer"):
        table.table_control(eagle3_result, masked)


def test_two_drafters_reading_other_rows_pair_their_per_sequence_rates(eagle3_result):
    """A block drafter's anchors are not a chain's rows: --against pairs the rates of each sequence (each
    sequence weighing the same), says so in the table's first line, and pairs acceptance length by prompt."""
    table = tables
    other = copy.deepcopy(eagle3_result)
    for row in other["buckets"]:
        row["rows_per_sequence"] = [2 * r for r in row["rows_per_sequence"]]  # twice the rows, the same hits
        row["rows"] *= 2
    here, there = eagle3_result["buckets"][-1], other["buckets"][-1]
    hits = np.asarray(here["none"]["per_sequence"]["agreement"], dtype=float)
    rates = hits / np.asarray(here["rows_per_sequence"], dtype=float)
    got = table.contrast(here, "none", "none", "agreement", there)
    assert got[0] == pytest.approx(float(np.mean(rates - rates / 2)), rel=1e-12)  # written out: half the rate there
    assert got[1] <= got[0] <= got[2]
    assert table.contrast(here, "none", "none", "acceptance_length", there)[0] == 0  # the same prompts, one number each
    text = table.table_against(eagle3_result, other, ("dflash", "eagle3"))
    assert "difference of their rates" in text.splitlines()[0] and "agreement dflash - eagle3" in text
    assert "difference of their rates" not in table.table_against(eagle3_result, copy.deepcopy(eagle3_result),
                                                                  ("a", "b")).splitlines()[0]
    empty = copy.deepcopy(other)
    empty["buckets"][-1]["rows_per_sequence"][0] = 0  # a sequence with no rows there has no rate
    assert table.contrast(here, "none", "none", "agreement", empty["buckets"][-1]) is None


@pytest.mark.parametrize("content,named", [
    (None, "cannot read it as JSON (FileNotFoundError)"),
    ("folder", "cannot read it as JSON (IsADirectoryError)"),
    ("{", "cannot read it as JSON (JSONDecodeError)"),
    ("[1, 2]", "not an eval result"),
    ('{"buckets": []}', "not an eval result"),
])
def test_eval_table_refuses_a_file_that_is_not_an_eval_result(tmp_path, content, named):
    table = tables
    path = tmp_path / "other.json"
    if content == "folder":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as stop:
        table.read_result(path, "--against")
    assert str(stop.value).startswith(f"--against {path}: ") and named in str(stop.value)
    assert "\n" not in str(stop.value)


def test_no_change_at_or_below_n_ref(eagle3_result):
    """alpha = 1 for n <= n_ref under both laws: mass and agreement are those of the plain drafter."""
    for row in eagle3_result["buckets"][:2]:
        for variant in ("spec", "qwen-logn", "window", "sinks"):
            assert row[variant]["mass"] == row["none"]["mass"]
            assert row[variant]["agreement"] == row["none"]["agreement"]
            assert row[variant]["delta_vs_none"]["agreement"] == [0.0, 0.0, 0.0]
            assert row[variant]["delta_vs_none"]["acceptance_length"] == [0.0, 0.0, 0.0]
    last = eagle3_result["buckets"][-1]
    assert last["spec"]["mass"] > last["none"]["mass"]  # sharper queries, more mass on the top keys
    # past the window the restricted head attends to fewer keys: its mass over them differs
    assert last["window"]["mass"] != last["none"]["mass"] and last["sinks"]["mass"] != last["window"]["mass"]


def test_scaling_tap_shows_the_meter_the_scaled_query():
    """Through ScalingTap the meter measures alpha(n) q, alpha from the theory's float64 law."""
    g = torch.Generator().manual_seed(0)
    query, key = torch.randn(1, 4, 100, 8, generator=g), torch.randn(1, 2, 100, 8, generator=g)
    n_visible = torch.arange(1, 101)[None]
    spec = ScaleSpec(law="log-linear", n_ref=16, slope=0.7, top_k=2)
    edges = bucket_edges([16, 64, 100])
    tapped, manual, plain = (MassMeter(edges, 2, rows_per_bucket=10) for _ in range(3))
    tap = ScalingTap(spec, tapped)
    tap(0, query.clone(), key, 0.35, n_visible)
    alpha = torch.as_tensor(spec.alpha(n_visible[0].numpy()), dtype=torch.float32)
    manual(0, query * alpha[None, None, :, None], key, 0.35, n_visible)
    plain(0, query, key, 0.35, n_visible)
    t, m, p = tapped.result(), manual.result(), plain.result()
    # the same float32 product up to the last ulp of alpha (torch's log against numpy's)
    np.testing.assert_allclose([t[b] for b in t], [m[b] for b in m], rtol=1e-5)
    assert t[0] == p[0] and t[2] > p[2]  # alpha = 1 up to n_ref = 16, sharper beyond: this test can fail
    assert torch.equal(tap.n_visible, n_visible)


def test_causal_lm_drafter(corpus):
    target = tiny_target(0)
    drafter = CausalLMAdapter(tiny_target(3), ByteTokenizer(), kind="hf", path="tiny", default_n_ref=64,
                              target=target)
    r = evaluate(drafter, EvalOptions(drafter="hf", spec=SPEC, lengths=LENGTHS, corpus=corpus, sequences=1,
                                      rows_per_bucket=8, speculative=True, new_tokens=6, num_draft=2))
    assert r["speculative"]["outputs_identical"] is True and r["speculative"]["loop"] == "sharpdraft-chain"
    first, last = r["buckets"][0], r["buckets"][-1]
    for variant in ("spec", "qwen-logn", "window", "sinks"):
        for key in ("mass", "agreement", "acceptance_length"):  # speedup is a timing
            assert first[variant][key] == first["none"][key]
    assert last["window"]["mass"] != last["none"]["mass"]
    # the taps' mask keeps the window: the rows count (and attend) at most W keys
    window = ScaleSpec(law="constant", n_ref=None, slope=0.0, top_k=2, window=16, sinks=2)
    forced = drafter.teacher_forced(torch.arange(1, 41)[None], [(None, None), (window, None)])
    assert torch.equal(forced.n_visible, torch.arange(1, 41).clamp(max=18))


def test_distance_fix_variants(eagle3, corpus):
    """clamp, group, pi and their +spec variants run end to end: speculative outputs stay the target's,
    clamp and pi (the identity up to n_ref by default) equal none at n <= n_ref, mass is not read."""
    r = evaluate(eagle3, EvalOptions(spec=SPEC, lengths=LENGTHS, corpus=corpus, sequences=1, rows_per_bucket=8,
                                     speculative=True, new_tokens=6, num_draft=2, variants=POSITION_VARIANTS))
    assert r["speculative"]["outputs_identical"] is True
    assert r["variants"]["group"]["positions"] == {"fix": "group", "window": 32, "group": 4, "n_ref": None}
    assert r["variants"]["clamp+spec"]["slope"] == 0.5 and r["variants"]["pi"]["positions"]["n_ref"] == 64
    first, second = r["buckets"][0], r["buckets"][1]
    for variant in ("clamp", "pi"):
        for bucket in (first, second):
            assert bucket[variant]["agreement"] == bucket["none"]["agreement"]
            assert bucket[variant]["acceptance_length"] == bucket["none"]["acceptance_length"]
    assert all(row[v]["mass"] is None for row in r["buckets"] for v in POSITION_VARIANTS)


def test_default_spec():
    s = default_spec(256, 4)
    assert (s.law, s.n_ref, s.slope, s.top_k) == ("log-linear", 256, 0.2, 4)


def test_plot(eagle3_result, tmp_path):
    plot_result(eagle3_result, tmp_path / "eval.png")
    assert (tmp_path / "eval.png").stat().st_size > 1000


@pytest.mark.parametrize("args, message", [
    (["--lengths", "256,abc"], "comma-separated integers"),
    (["--lengths", "1"], ">= 2"),
    (["--plot", "out.pdf"], "give a .png"),
    (["--drafter", "medusa"], "--drafter medusa: expected one of hf, pard, eagle3, dflash"),
    (["--lengths", "256,16384"], "from 2 to 8192"),
    (["--variants", "none,magic"], "unknown variant 'magic'"),
    (["--variants", ","], "--variants: give at least one"),
    (["--variants", "spec,spec"], "named twice"),
    (["--variants", "none,reference"], "pass --reference-drafter-path"),
    (["--window", "0"], "--window 0: expected a positive number"),
    (["--sinks", "0"], "--sinks 0: expected a positive number"),
    (["--window", "8", "--sinks", "8"], "--sinks 8: must be below --window 8"),
    (["--sequences", "0"], "--sequences 0: expected at least 1"),
    (["--reference-drafter-path", "/no/such/head"], "--reference-drafter-path /no/such/head: no such folder"),
    (["--n-ref", "0"], "--n-ref 0: expected at least 2"),
    (["--n-ref", "-64"], "--n-ref -64: expected at least 2"),
    (["--n-ref", "2048"], "--n-ref 2048: expected at least 2 and below the largest of --lengths (2048)"),
    (["--n-ref", "99999999999"], "--n-ref 99999999999"),
])
def test_cli_user_errors(args, message):
    result = CliRunner().invoke(app, ["eval", *args])
    assert isinstance(result.exception, UserError)
    assert message in str(result.exception)


def test_skip_past_the_corpus(eagle3, corpus):
    with pytest.raises(UserError, match="--skip 50"):
        evaluate(eagle3, EvalOptions(spec=SPEC, lengths=LENGTHS, corpus=corpus, sequences=1, skip=50))


def test_bootstrap_resamples_sequences_not_rows():
    """Two sequences of 10 rows, all hits in one: the sequence bootstrap spans 0 .. 0.1 (row resampling would not)."""
    mean, lo, hi = paired_bootstrap(np.array([1.0, 0.0]), np.array([10.0, 10.0]))
    assert mean == pytest.approx(0.05)
    # resampling 2 sequences: both the first (0.1), one each (0.05), both the second (0.0), each with its share
    assert (lo, hi) == (0.0, pytest.approx(0.1))
    assert paired_bootstrap(np.zeros(3), np.zeros(3)) is None
    diffs = np.array([0.2, 0.1, 0.3, 0.0])  # a paired difference per sequence
    exact = np.mean(diffs)
    mean, lo, hi = paired_bootstrap(diffs)
    assert mean == pytest.approx(exact, abs=1e-15) and lo < exact < hi


def test_one_sequence_has_no_interval():
    """One sequence cannot be resampled: the mean is reported, the interval is not (never [x, x])."""
    assert paired_bootstrap(np.array([3.0]), np.array([4.0])) == [0.75, None, None]


def test_mass_meter_sees_the_window():
    """The window variant's meter measures the mass over the keys the window keeps, in float64."""
    g = torch.Generator().manual_seed(1)
    query, key = torch.randn(1, 2, 50, 8, generator=g), torch.randn(1, 2, 50, 8, generator=g)
    restrict = ScaleSpec(law="constant", n_ref=None, slope=0.0, top_k=2, window=10, sinks=2)
    meter = MassMeter(bucket_edges([50]), 2, rows_per_bucket=50, restrict=restrict)
    meter(0, query, key, 0.35, torch.arange(1, 51)[None])
    logits = (query[0].double() @ key[0].double().transpose(-1, -2)) * 0.35  # (heads, 50, 50)
    masses = []
    for p in range(2, 50):  # rows with more than top_k keys
        keep = [j for j in range(p + 1) if j > p - 10 or j < 2]
        w = torch.softmax(logits[:, p, keep], -1)
        masses.append(w.topk(2, -1).values.sum(-1).mean())
    np.testing.assert_allclose(meter.result()[0], float(np.mean(masses)), rtol=1e-6)  # float32 logits


def test_reference_head_and_the_share_it_recovers(eagle3, corpus, tmp_path):
    target = eagle3.target
    other = Eagle3Adapter(load_eagle3_head(write_tiny_eagle3(tmp_path, target, seed=7), target), target,
                          ByteTokenizer(), path="other")
    r = evaluate(eagle3, EvalOptions(spec=SPEC, lengths=LENGTHS, corpus=corpus, sequences=3, rows_per_bucket=8,
                                     variants=("none", "spec", "window", "reference"),
                                     reference_drafter_path=str(tmp_path)), reference=other)
    assert list(r["variants"]) == ["none", "spec", "window", "reference"] and r["reference"]["path"] == "other"
    assert r["sequences"] == 3
    for row in r["buckets"]:
        mean, lo, hi = row["reference"]["delta_vs_none"]["agreement"]
        for variant in ("spec", "window"):
            share = row[variant]["recovered"]["agreement"]
            if lo > 0:
                assert share == pytest.approx(row[variant]["delta_vs_none"]["agreement"][0] / mean, abs=1e-3)
            else:
                assert share is None
    assert any(row["reference"]["agreement"] != row["none"]["agreement"] for row in r["buckets"])  # another head
    with pytest.raises(UserError, match="pass --reference-drafter-path"):
        evaluate(eagle3, EvalOptions(spec=SPEC, lengths=LENGTHS, corpus=corpus, sequences=1, variants=("reference",)))


def test_recovered_is_a_share_of_a_significant_gain_only():
    from calibrate.eval.run import _recovered

    def bucket(reference):
        return {"reference": {"delta_vs_none": {"agreement": reference}},
                "spec": {"delta_vs_none": {"agreement": [0.01, 0.0, 0.02]}}}

    rows = [bucket([0.04, 0.02, 0.06]), bucket([-0.04, -0.06, -0.02]), bucket([0.04, -0.01, 0.09])]
    _recovered(rows, ["none", "spec", "reference"])
    assert [row["spec"]["recovered"]["agreement"] for row in rows] == [0.25, None, None]


def test_every_sequence_by_default(eagle3, corpus):
    r = evaluate(eagle3, EvalOptions(spec=SPEC, lengths=[64], corpus=corpus, rows_per_bucket=4, variants=("none",)))
    assert r["sequences"] == 1109 // 64  # the corpus's 1109 byte tokens hold 17 sequences of 64


def test_n_ref_moves_qwen_logn_and_the_window(eagle3, corpus):
    """``--n-ref`` replaces the drafter's own training length: qwen-logn starts there and the window is W = n_ref,
    so the bucket at 64 (<= the head's n_ref 64, > the given 32) is no longer the plain drafter's."""
    r = evaluate(eagle3, EvalOptions(spec=SPEC, lengths=[32, 64], corpus=corpus, sequences=2, rows_per_bucket=8,
                                     variants=("none", "qwen-logn", "window"), n_ref=32))
    assert r["drafter"]["n_ref"] == 32
    assert r["variants"]["qwen-logn"]["n_ref"] == 32 and r["variants"]["window"]["window"] == 32
    at_32, at_64 = r["buckets"]
    assert at_32["window"]["mass"] == at_32["none"]["mass"] and at_32["qwen-logn"]["mass"] == at_32["none"]["mass"]
    assert at_64["window"]["mass"] != at_64["none"]["mass"] and at_64["qwen-logn"]["mass"] != at_64["none"]["mass"]


# -- the terminal summary -------------------------------------------------------------------------

def _check_fits_80_columns(text: str, variants, metrics) -> None:
    """No line past 80 columns, nothing cut short ('…'), every variant and metric named in full."""
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80, max(lines, key=len)
    assert "…" not in text
    cells = {cell.strip() for line in lines for cell in line.strip("│┃ ").replace("┃", "│").split("│")}
    assert set(variants) <= cells, set(variants) - cells
    assert all(any(line.strip().startswith(m.replace("_", " ")) for line in lines) for m in metrics)


def test_summary_at_80_columns_whatever_the_variants_and_metrics(eagle3_result, monkeypatch, capsys):
    """Variants and metrics added later (names not known here) get rows of their own, still in 80 columns,
    each interval on one line."""
    from copy import deepcopy

    from calibrate.eval.report import print_summary

    result = deepcopy(eagle3_result)
    extra = ["window+spec", "clamp", "qwen-logn+window", "reference"]
    for variant in extra:
        result["variants"][variant] = None
        for row in result["buckets"]:
            row[variant] = {**deepcopy(row["spec"]), "recovered": {"agreement": 0.5}}
    for row in result["buckets"]:
        for variant in result["variants"]:
            row[variant]["expected_acceptance"] = 1.5
            if variant != "none":
                row[variant]["delta_vs_none"]["expected_acceptance"] = [-0.125, -0.25, 0.0625]
    monkeypatch.setenv("COLUMNS", "80")
    print_summary(result)
    out = capsys.readouterr().out
    _check_fits_80_columns(out, result["variants"], ["mass", "agreement", "acceptance_length", "expected_acceptance"])
    # one interval per (bucket, variant but none) for each of agreement, acceptance and the new metric, on one line
    assert out.count("-0.125 [-0.250, +0.062]") == len(result["buckets"]) * (len(result["variants"]) - 1)
    assert "recovered" in out and "0.500" in out


def test_cli_summary_at_80_columns(tmp_path):
    """``COLUMNS=80 sharpdraft eval``: the real command's output, headers and variant names whole."""
    from test_calibrate import _write_tokenizer

    target = tiny_target(0)
    target.save_pretrained(tmp_path / "target")
    _write_tokenizer(tmp_path / "target")
    write_tiny_eagle3(tmp_path / "eagle3", target, seed=1)
    (tmp_path / "corpus.txt").write_text(" ".join(["the query sees more keys as the context grows"] * 40))
    args = ["eval", "--drafter-path", str(tmp_path / "eagle3"), "--target-path", str(tmp_path / "target"),
            "--corpus", str(tmp_path / "corpus.txt"), "--lengths", "32,64,128", "--sequences", "2",
            "--device", "cpu", "--speculative", "--new-tokens", "4", "--num-draft", "2"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    _check_fits_80_columns(result.stdout, DEFAULT_VARIANTS, ["mass", "agreement", "acceptance_length", "speedup"])


def test_the_summary_names_each_deployment_in_a_few_words():
    from calibrate.eval.report import spec_label

    clamp = {"fix": "clamp", "window": 255, "group": None, "n_ref": None}
    assert spec_label({"law": "log-linear", "slope": 0.24718738599986925, "positions": clamp}) == \
        "clamp W=255 + log-linear slope 0.2472"
    assert spec_label({"law": "constant", "slope": 0.0, "window": 256, "sinks": 4}) == "window 256 + 4 sinks"
    assert spec_label({"law": "log-linear", "slope": 0.2}) == "log-linear slope 0.2"
    assert spec_label({"law": "constant", "slope": 0.0, "alpha": 1.25}) == "constant alpha 1.25"


def test_extra_specs_share_the_passes_and_pair_with_spec(eagle3, corpus):
    """``--extra-spec``: a per-head spec whose heads all carry the global slope measures exactly as ``spec``
    (same rows, same drafts, speculative runs included); another slope leaves n <= n_ref alone and moves
    the mass past it; the pairing with ``spec`` needs no second pass."""
    heads = ScaleSpec(law="log-linear", n_ref=64, slope=[[0.5] * 4], top_k=2, granularity="head")
    steeper = ScaleSpec(law="log-linear", n_ref=64, slope=1.5, top_k=2)
    r = evaluate(eagle3, EvalOptions(spec=SPEC, lengths=LENGTHS, corpus=corpus, sequences=2, rows_per_bucket=16,
                                     speculative=True, new_tokens=6, num_draft=2, variants=["none", "spec"],
                                     extra_specs={"spec:heads": heads, "spec:steep": steeper}))
    assert list(r["variants"]) == ["none", "spec", "spec:heads", "spec:steep"]
    assert r["speculative"]["outputs_identical"] is True
    table = tables
    for row in r["buckets"]:
        for metric in ("mass", "agreement", "expected_acceptance", "acceptance_length"):
            assert row["spec:heads"][metric] == row["spec"][metric]
        assert table.contrast(row, "spec:heads", "spec", "agreement")[0] == 0
    for row in r["buckets"][:2]:  # n <= n_ref
        assert row["spec:steep"]["mass"] == row["none"]["mass"]
    last = r["buckets"][-1]
    assert last["spec:steep"]["mass"] > last["spec"]["mass"] > last["none"]["mass"]
    with pytest.raises(UserError, match="top_k 4 is not the run's 2"):
        k4 = ScaleSpec(law="log-linear", n_ref=64, slope=0.5, top_k=4)
        EvalOptions(spec=SPEC, lengths=LENGTHS, corpus=corpus, sequences=1, variants=["none"],
                    extra_specs={"spec:k4": k4})


def test_cli_extra_spec_is_a_variant_and_resumes(tmp_path, monkeypatch):
    """``sharpdraft eval --extra-spec layer=FILE``: the variant spec:layer in the JSON and the summary, its
    file named in the result; a --resume whose file now holds another spec is refused, the same one resumes."""
    from test_calibrate import _write_tokenizer

    from calibrate.measure import SavedUnits

    target = tiny_target(0)
    target.save_pretrained(tmp_path / "target")
    _write_tokenizer(tmp_path / "target")
    write_tiny_eagle3(tmp_path / "eagle3", target, seed=1)
    (tmp_path / "corpus.txt").write_text(" ".join(["the query sees more keys as the context grows"] * 40))
    layer = tmp_path / "layer.json"
    ScaleSpec(law="log-linear", n_ref=64, slope=[0.3], top_k=4, granularity="layer").save(layer)
    args = ["eval", "--drafter-path", str(tmp_path / "eagle3"), "--target-path", str(tmp_path / "target"),
            "--corpus", str(tmp_path / "corpus.txt"), "--lengths", "32,64,128", "--sequences", "1",
            "--device", "cpu", "--variants", "none,spec", "--extra-spec", f"layer={layer}",
            "--out", str(tmp_path / "r.json")]
    monkeypatch.setattr(SavedUnits, "finish", lambda self: None)  # the partial stays, as an interrupted run's
    result = CliRunner().invoke(app, args, env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "spec:layer: log-linear slope 0.3 (mean of one per layer)" in " ".join(result.stdout.split())
    saved = json.loads((tmp_path / "r.json").read_text())
    assert list(saved["variants"]) == ["none", "spec", "spec:layer"]
    assert saved["extra_spec_files"] == {"spec:layer": str(layer)}
    assert saved["weights"] == {"device": "cpu", "dtype": "float32"}
    assert saved["variants"]["spec:layer"]["granularity"] == "layer"
    ScaleSpec(law="log-linear", n_ref=64, slope=[0.4], top_k=4, granularity="layer").save(layer)
    refused = CliRunner().invoke(app, [*args, "--resume"])
    assert isinstance(refused.exception, UserError) and "extra_specs" in str(refused.exception)
    ScaleSpec(law="log-linear", n_ref=64, slope=[0.3], top_k=4, granularity="layer").save(layer)
    resumed = CliRunner().invoke(app, [*args, "--resume", "--json"])
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(resumed.stdout)["buckets"] == saved["buckets"]


def test_a_saved_prompt_keeps_three_or_five_numbers_per_run():
    """A resumed prompt from before the drafter's time was kept has 3 numbers a run, a new one 5; others are refused."""
    from calibrate.eval.decode import _prompt_unit

    unit = {"identical": True, "base": [1.0, 8], "drafters": {"none": "eagle3"}}
    for run in ([1.5, 0.5, 8], [1.5, 0.5, 8, 0.1, 5]):
        assert _prompt_unit({**unit, "runs": {"none": run}}, ["none"])["runs"]["none"] == run
    for run in ([1.5, 0.5, 8, 0.1], [1.5, 0.5, 8, -0.1, 5], [1.5, 0.5, 8, float("nan"), 5]):
        with pytest.raises(ValueError, match="3 or 5 finite numbers"):
            _prompt_unit({**unit, "runs": {"none": run}}, ["none"])


def test_a_greedy_mismatch_under_half_precision_names_the_dtype_and_the_exact_way():
    """The summary's NO beside non-identical greedy outputs says, in bfloat16 or float16, that rounding can turn
    a near-tie and that --dtype float32 compares exactly; in float32 (or a result without the record) nothing."""
    from calibrate.eval.report import _half_note

    for dtype in ("bfloat16", "float16"):
        note = _half_note({"weights": {"device": "cuda", "dtype": dtype}})
        assert dtype in note and "--dtype float32" in note
    assert _half_note({"weights": {"device": "cpu", "dtype": "float32"}}) == ""
    assert _half_note({}) == ""


def test_options_are_settled_once_and_keyed_for_resume(corpus, tmp_path, eagle3):
    """``EvalOptions`` settles what its checks decide (sorted lengths, none first, the reference as a variant,
    seed 0, the spec's top-k); ``to_dict`` keys a resumed run; ``evaluate`` refuses options of another drafter."""
    opts = EvalOptions(spec=SPEC, lengths=[128, 32, 64, 64], corpus=corpus, variants=["spec"],
                       reference_drafter_path=str(tmp_path))
    assert opts.lengths == (32, 64, 128) and opts.variants == ("none", "spec", "reference")
    assert (opts.seed, opts.top_k, opts.online, opts.lookup.max_ngram) == (0, 2, None, 2)
    key = opts.to_dict()
    assert key["variants"] == ["none", "spec", "reference"] and key["spec"] == SPEC.to_dict() and key["lookup"] is None
    assert EvalOptions(spec=SPEC, lengths=[32, 64, 128], corpus=corpus, variants=["spec"],
                       reference_drafter_path=str(tmp_path), temperature=0.5).to_dict() != key
    with pytest.raises(ValueError, match="the drafter is eagle3, the options are for hf"):
        evaluate(eagle3, EvalOptions(drafter="hf", spec=SPEC, lengths=LENGTHS, corpus=corpus))
