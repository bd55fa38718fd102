"""Generated corpora (``--corpus generated:...``) in calibrate, ``--select`` and eval, and eval by output position.

The run folders are written here by ``sharpdraft generate``'s own code from a tiny random target (greedy, the
end-of-sequence token barred, so every output runs to its length), or by hand for the refusals.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.corpus import documents, pack
from calibrate.drafters import load_drafter
from calibrate.errors import UserError
from calibrate.generate import GenerateOptions, read_generations, run_generation
from calibrate.generated import copied_tokens, generated_sequences, read_corpus
from calibrate.measure import Arm, Tally, tally_sequence
from calibrate.measure.forced import _per_bucket
from calibrate.measure.longgen import looped, output_edges, regroup, summarize_bins
from calibrate.preflight import check_corpus
from calibrate.run import CalibrateOptions, run_calibration

from test_calibrate import VOCAB, _write_tokenizer
from tiny_checkpoints import tiny_target, write_tiny_eagle3

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 120  # tokens each prompt generates: every sequence reaches 128 tokens, the longest length
PROMPTS = [("a", "Tell me a story.", "train"), ("b", "Count to ten, please.", "train"),
           ("c", "Why is the sky blue?", "heldout"), ("d", "Write a long diary entry.", "heldout")]


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    """A tiny target with its tokenizer, an EAGLE-3 head for it, a workload and its greedy generation run."""
    root = tmp_path_factory.mktemp("gen")
    target = tiny_target(0, vocab_size=VOCAB)
    target.save_pretrained(root / "target")
    _write_tokenizer(root / "target")
    write_tiny_eagle3(root / "eagle3", target, seed=1)
    workload = root / "w.jsonl"
    workload.write_text("".join(json.dumps({"id": i, "prompt": p, "split": s}) + "\n" for i, p, s in PROMPTS))
    run_generation(GenerateOptions(workload=f"{workload}:all", out=root / "run", new_tokens=NEW, min_new_tokens=NEW,
                                   temperature=0.0, batch=4, target_path=str(root / "target")))
    return root


def _copy_run(fx: Path, to: Path, **run_edits) -> Path:
    shutil.copytree(fx / "run", to)
    run = json.loads((to / "run.json").read_text())
    run.update(run_edits)
    (to / "run.json").write_text(json.dumps(run))
    return to


def test_sequences_are_prompt_then_output_as_written_split_by_the_workload(fx):
    heldout = generated_sequences(f"generated:{fx}/run:heldout", 100)
    assert [s.id for s in heldout] == ["c", "d"]
    for s in heldout:
        g = json.loads((fx / "run" / "prompts" / f"{s.id}.json").read_text())
        assert s.ids == (g["prompt_ids"] + g["output_ids"])[:100] and s.prompt_length == len(g["prompt_ids"])
    assert [s.id for s in generated_sequences(f"generated:{fx}/run", 100)] == ["a", "b"]  # train by default
    assert len(generated_sequences(f"generated:{fx}/run:all", 100, limit=3)) == 3
    assert list(pack(f"generated:{fx}/run:heldout", None, None, 100)) == [s.ids for s in heldout]


def test_a_generation_shorter_than_the_length_is_left_out_and_none_long_enough_is_refused(fx, tmp_path):
    run = _copy_run(fx, tmp_path / "run")
    short = json.loads((run / "prompts" / "c.json").read_text())
    short["output_ids"] = short["output_ids"][:5]
    (run / "prompts" / "c.json").write_text(json.dumps(short))
    assert [s.id for s in generated_sequences(f"generated:{run}:heldout", 100)] == ["d"]
    with pytest.raises(UserError, match=r"none of its 2 generations holds 1000 tokens \(the longest: 1"):
        generated_sequences(f"generated:{run}:heldout", 1000)


def test_splits_come_from_the_recorded_workload_else_every_prompt_is_train(fx, tmp_path):
    run = json.loads((fx / "run" / "run.json").read_text())
    elsewhere = {**run["settings"]["workload"], "path": "/another/machine/w.jsonl", "name": "w"}
    moved = _copy_run(fx, tmp_path / "moved", settings={**run["settings"], "workload": elsewhere})
    assert [g.id for g in read_corpus(f"generated:{moved}").generations] == ["a", "b", "c", "d"]
    with pytest.raises(UserError, match="no finished generation in the heldout split"):
        read_corpus(f"generated:{moved}:heldout")


@pytest.mark.parametrize("source, message", [
    ("generated:", "expected generated:NAME"),
    ("generated:poetry", "'poetry' is neither a shipped generated corpus"),
    ("generated:diary:test", "unknown split 'test'"),
    ("recall:generated:diary", "token ids, not text"),
])
def test_bad_names_are_refused_in_one_line(source, message):
    with pytest.raises(UserError, match=message):
        read_corpus(source) if not source.startswith("recall:") else next(documents(source))


def test_a_shipped_corpus_missing_from_the_install_says_how_to_write_one(monkeypatch, tmp_path):
    monkeypatch.setattr("calibrate.generated.shipped_path", lambda name: tmp_path / name)
    missing = ("shipped corpus math-greedy is not in this install.*--workload math:all --new-tokens 4096 "
               "--min-new-tokens 4096 --temperature 0 ")
    with pytest.raises(UserError, match=missing):
        read_corpus("generated:math-greedy:heldout")
    missing = "diary-long is not in this install.*--workload diary:heldout --new-tokens 7890"
    with pytest.raises(UserError, match=missing):
        read_corpus("generated:diary-long:heldout")


def test_corpus_text_describes_a_run_and_refuses_a_folder_that_is_not_one(fx, tmp_path):
    script = Path(__file__).resolve().parents[1] / "scripts" / "corpus_text.py"
    run = lambda *a: subprocess.run([sys.executable, str(script), *map(str, a)], capture_output=True, text=True)  # noqa: E731
    done = run(fx / "run", "--bin-size", 60)
    assert done.returncode == 0, done.stderr
    periods = [looped(g.output_ids) for g in read_generations(fx / "run")]
    assert done.stdout.startswith(f"run: 4 prompts, {NEW}-{NEW} tokens (4 to the limit, 0 at the end marker, 0 ended); "
                                  f"{sum(p is not None for p in periods)} end in a loop")
    assert "distinct 4-grams first 60 tokens" in done.stdout and "last 60" in done.stdout
    (tmp_path / "empty").mkdir()
    for bad, message in ((tmp_path / "empty", "not a generation run"), (fx / "run", "--bin-size 0")):
        refused = run(bad, "--bin-size", 0 if bad == fx / "run" else 512)
        assert refused.returncode == 1 and message in refused.stderr and len(refused.stderr.splitlines()) == 1


def test_a_folder_that_is_not_a_run_and_a_half_written_generation_are_refused(fx, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="is not a generation run"):
        read_corpus(f"generated:{tmp_path / 'empty'}")
    run = _copy_run(fx, tmp_path / "half")
    (run / "prompts" / "c.json").write_text('{"id": "c", "prompt_ids": [1')
    with pytest.raises(UserError, match="c.json: not a finished generation"):
        read_corpus(f"generated:{run}:heldout")


def test_another_tokenizer_is_refused_before_any_weights_load(fx, tmp_path, monkeypatch):
    run = _copy_run(fx, tmp_path / "other", tokenizer="0123456789abcdef")
    monkeypatch.setattr("calibrate.drafters.load_drafter", lambda *a, **k: pytest.fail("a drafter loaded"))
    with pytest.raises(UserError, match="generated with tokenizer 0123456789abcdef, not the target's"):
        check_corpus(f"generated:{run}", 128, drafter="eagle3", drafter_path=str(fx / "eagle3"),
                     target_path=str(fx / "target"))
    check_corpus(f"generated:{fx / 'run'}", 128, drafter="eagle3", drafter_path=str(fx / "eagle3"),
                 target_path=str(fx / "target"))


def test_output_bins_by_hand():
    """Sequence of 16 rows (n = t + 1), a prompt of 3 tokens, bins of 4, context edges 8 and 16: output positions
    t - 3, so bin 0 holds t = 3..6, bin 1 t = 7..10, bin 2 t = 11..14, bin 3 t = 15; the context buckets
    t = 0..7 and 8..15. Each row's value is t."""
    edges = np.array([8, 16])
    fine, context, bins = output_edges(edges, prompt_length=3, bin_size=4)
    n = np.arange(1, 17)
    t = n - 1.0
    tally = Tally(rows=_per_bucket(fine, n, np.ones(16)), sums={"x": {"agreement": _per_bucket(fine, n, t)}},
                  mass={"x": np.zeros((2, len(fine)))})
    by_bin, by_n = regroup(tally, bins, 4), regroup(tally, context, 2)
    assert by_bin.rows.tolist() == [4, 4, 4, 1]
    assert by_bin.sums["x"]["agreement"].tolist() == [3 + 4 + 5 + 6, 7 + 8 + 9 + 10, 11 + 12 + 13 + 14, 15]
    assert by_n.rows.tolist() == [8, 8] and by_n.sums["x"]["agreement"].tolist() == [sum(range(8)), sum(range(8, 16))]
    assert copied_tokens([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9]).astype(int).tolist() == [0] * 7 + [1] * 4 + [0]


def test_copy_share_by_hand():
    """One bin, two sequences: 10 rows each, 4 and 2 of them copy rows; the arm gets 5 and 3 rows right, 2 and 1
    of them copy rows: copy share (2 + 1) / (5 + 3); the target gets every row right: (4 + 2) / 20."""
    def tally(copy_rows, right, right_copies):
        one = lambda x: np.array([float(x)])  # noqa: E731
        sums = {m: one(v) for m, v in (("agreement", right), ("expected_acceptance", right),
                                       ("copy_agreement", right_copies), ("copy_expected_acceptance", right_copies),
                                       ("other_agreement", right - right_copies),
                                       ("other_expected_acceptance", right - right_copies))}
        return Tally(rows=one(10), sums={"none": sums, "target": {"copy_accuracy": one(copy_rows),
                                                                  "other_accuracy": one(10 - copy_rows)}},
                     mass={"none": np.zeros((2, 1))}, subsets={"copy": one(copy_rows), "other": one(10 - copy_rows)})

    [row] = summarize_bins([tally(4, 5, 2), tally(2, 3, 1)], [Arm("none")], 512)
    assert (row["start"], row["end"], row["sequences"]) == (0, 512, 2)
    assert row["none"]["copy_share"] == round(3 / 8, 4) and row["target"]["copy_share"] == 0.3
    assert row["copy_rows_share"][0] == 0.3 and len(row["none"]["copy_share_interval"]) == 2


def test_one_pass_gives_the_context_buckets_a_plain_pass_gives(fx):
    """The finer buckets summed back over context lengths equal a pass over the context edges alone, row for row."""
    drafter = load_drafter("eagle3", str(fx / "eagle3"), str(fx / "target"), torch.device("cpu"), torch.float32)
    seq = generated_sequences(f"generated:{fx}/run:heldout", 128)[0]
    edges = np.array([32, 64, 128])
    arms = [Arm("none")]
    ids, copied = torch.tensor([seq.ids]), copied_tokens(seq.ids)
    plain = tally_sequence(drafter, ids, arms, edges, top_k=4, copied=copied)
    fine, context, bins = output_edges(edges, seq.prompt_length, 32)
    both = tally_sequence(drafter, ids, arms, fine, top_k=4, copied=copied)
    again = regroup(both, context, len(edges))
    assert again.rows.tolist() == plain.rows.tolist()
    for arm, sums in plain.sums.items():
        for metric, values in sums.items():
            np.testing.assert_allclose(again.sums[arm][metric], values, rtol=0, atol=1e-9)  # the same rows, re-added
    out = regroup(both, bins, 4)
    assert out.rows.sum() == 127 - seq.prompt_length  # every row from the prompt's end on, in some bin
    summary = summarize_bins([out, out], arms, 32)
    assert [b["start"] for b in summary] == [0, 32, 64, 96] and summary[0]["sequences"] == 2


def test_cli_eval_on_a_generated_corpus_reports_by_output_position(fx, tmp_path):
    """The issue's command at a tiny scale: per output bin, every arm's agreement, expected acceptance and copy
    share with paired intervals over sequences, in the JSON and the printed table."""
    args = ["eval", "--drafter", "eagle3", "--drafter-path", str(fx / "eagle3"), "--target-path", str(fx / "target"),
            "--corpus", f"generated:{fx / 'run'}:heldout", "--lengths", "32,64,128", "--sequences", "2",
            "--variants", "none,spec,window", "--bin-size", "32", "--device", "cpu", "--threads", "1"]
    result = CliRunner().invoke(app, [*args, "--json", "--out", str(tmp_path / "e.json"), "--plot",
                                      str(tmp_path / "e.png")])
    assert result.exit_code == 0, result.output
    r = json.loads((tmp_path / "e.json").read_text())
    assert (tmp_path / "e.png").stat().st_size > 0  # with a panel by output position (calibrate/plots/eval.py)
    prompts = r["generated"]["prompt_lengths"]
    assert r["generated"]["ids"] == ["c", "d"] and r["generated"]["split"] == "heldout"
    assert r["output_bins"]["bin_size"] == 32
    bins = r["output_bins"]["bins"]
    assert len(bins) == -(-(128 - min(prompts)) // 32)
    for s, p in enumerate(prompts):  # the head's 127 rows: those from the prompt's end on, each in one bin
        assert sum(b["rows_per_sequence"][s] for b in bins) == 127 - p
    for b in bins[:2]:
        assert b["sequences"] == 2
        for arm in ("none", "spec", "window"):
            cell = b[arm]
            assert 0 <= cell["agreement"] <= 1 and 0 <= cell["expected_acceptance"] <= 1
            assert len(cell["agreement_interval"]) == 2 and len(cell["expected_acceptance_interval"]) == 2
            assert cell["copy_share"] is None or 0 <= cell["copy_share"] <= 1
            if arm != "none":
                assert len(cell["delta_vs_none"]["agreement"]) == 3
    per_n = {row["n"]: row for row in r["buckets"]}
    assert set(per_n) == {32, 64, 128} and "copy_agreement" in per_n[128]["none"]
    printed = CliRunner().invoke(app, args, env={"COLUMNS": "120"})
    assert printed.exit_code == 0, printed.output
    assert "by output position" in printed.stdout and "copy share" in printed.stdout
    # the markdown of scripts/eval_table.py --by-output: a row per bin, none's value and each difference as eval
    # paired it
    from calibrate.eval.tables import output_table

    with pytest.raises(SystemExit, match="--by-output mass: not a metric"):
        output_table(r, "mass")
    rows = [line for line in output_table(r).splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == len(bins)
    for line, b in zip(rows, bins):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == f"{b['start']}-{b['end']}" and cells[2] == f"{b['none']['expected_acceptance']:.3f}"
        for cell, v in zip(cells[3:], ("spec", "window")):  # the paired mean eval gives (the intervals resampled anew)
            assert cell.strip("*").split(" ")[0] == f"{b[v]['delta_vs_none']['expected_acceptance'][0]:+.3f}"


def test_an_interrupted_eval_on_a_generated_corpus_resumes_to_the_same_bins(fx, tmp_path, monkeypatch):
    from calibrate.measure import SavedUnits

    args = ["eval", "--drafter", "eagle3", "--drafter-path", str(fx / "eagle3"), "--target-path", str(fx / "target"),
            "--corpus", f"generated:{fx / 'run'}:all", "--lengths", "64,128", "--sequences", "2", "--variants",
            "none,window", "--bin-size", "48", "--device", "cpu", "--threads", "1", "--out", str(tmp_path / "e.json")]
    monkeypatch.setattr(SavedUnits, "finish", lambda self: None)  # the partial stays, as an interrupted run's
    first = CliRunner().invoke(app, [*args, "--json"])
    assert first.exit_code == 0, first.output
    saved = json.loads((tmp_path / "e.json").read_text())
    again = CliRunner().invoke(app, [*args, "--json", "--resume"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["output_bins"] == saved["output_bins"]
    other = CliRunner().invoke(app, [*args[:-2], "--bin-size", "32", "--out", str(tmp_path / "e.json"), "--resume"])
    assert other.exit_code == 1 and "bin_size" in str(other.exception)


def test_calibrate_and_select_on_a_generated_corpus(fx, tmp_path):
    """calibrate reads the train split's sequences as they are; --select measures its candidates on them."""
    opts = CalibrateOptions(out=tmp_path / "spec.json", drafter="eagle3", drafter_path=str(fx / "eagle3"),
                            target_path=str(fx / "target"), corpus=f"generated:{fx / 'run'}", max_length=128,
                            sequences=4, n_ref=64, device="cpu", bootstrap=20, select=True)
    result = run_calibration(opts)
    assert result.tokens == 2 * 128  # the two train prompts, 128 tokens each
    assert any("only 2 sequences" in note for note in result.notes)
    assert result.selection is not None and result.spec.calibration.corpus == f"generated:{fx / 'run'}"


def test_calibrate_refuses_another_tokenizer_once_the_drafter_tells_it(fx, tmp_path):
    """An hf checkpoint with no target reads its own tokenizer: checked as soon as it loads, before any pass."""
    from test_calibrate import _write_causal_lm

    run = _copy_run(fx, tmp_path / "other", tokenizer="0123456789abcdef")
    opts = CalibrateOptions(out=tmp_path / "spec.json", drafter="hf", drafter_path=str(_write_causal_lm(tmp_path / "hf")),
                            corpus=f"generated:{run}", max_length=128, sequences=2, n_ref=64, device="cpu")
    with pytest.raises(UserError, match="not the drafter's"):
        run_calibration(opts)


@pytest.mark.parametrize("name, split, prompts, tokens", [
    ("diary", "train", 12, 4096), ("diary", "heldout", 4, 4096), ("math", "train", 12, 4096),
    ("math", "heldout", 4, 4096), ("science", "train", 12, 4096), ("science", "heldout", 4, 4096),
    ("diary-greedy", "all", 16, 4096), ("math-greedy", "all", 16, 4096), ("science-greedy", "all", 16, 4096),
    ("diary-long", "heldout", 4, 7890),
])
def test_the_shipped_corpora_hold_what_the_docs_say(name, split, prompts, tokens):
    """docs/longgen.md's table of shipped corpora: each split's prompts, every output as long as stated, one
    tokenizer identity; diary-long is the held-out diaries to the end of the target's context."""
    from calibrate.generate import tokenizer_and_context, tokenizer_identity

    corpus = read_corpus(f"generated:{name}:{split}")
    assert len(corpus.generations) == prompts
    assert corpus.tokenizer == tokenizer_identity(tokenizer_and_context(None)[0])  # the built-in target's
    assert all(len(g.output_ids) == tokens for g in corpus.generations)
    if name.endswith("-greedy"):  # greedy: settings recorded, and each split as the workload has it
        assert json.loads((corpus.folder / "run.json").read_text())["settings"]["greedy"] is True
        assert len(read_corpus(f"generated:{name}:heldout").generations) == 4
    if name == "diary-long":
        assert min(len(g.prompt_ids) + len(g.output_ids) for g in corpus.generations) >= 8176
        with pytest.raises(UserError, match="no finished generation in the train split"):
            read_corpus("generated:diary-long")
