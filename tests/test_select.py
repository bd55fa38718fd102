"""``sharpdraft calibrate --select``: the rule on made-up gains, and the whole run on a tiny EAGLE-3 head."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.drafters import load_drafter
from calibrate.errors import UserError
from calibrate.run import CalibrateOptions, run_calibration
from calibrate.select import RULE, candidates, choose
from sharpdraft_theory.spec import ScaleSpec, schema_path

from tiny_checkpoints import tiny_target, write_tiny_eagle3


def _cells(**gains):
    """Candidates' cells with the given agreement gains [mean, lo, hi] (None: not measured)."""
    cells = {"none": {"deployment": None}}
    for name, g in gains.items():
        cells[name] = {"gain": {"agreement": g, "expected_acceptance": g}}
    return cells


def test_the_rule_takes_the_largest_gain_whose_interval_excludes_zero():
    cells = _cells(spec=[0.05, -0.01, 0.11], window_256=[0.03, 0.01, 0.05], clamp=[0.02, 0.005, 0.04])
    assert choose(cells)[0] == "window_256"  # spec's mean is larger, but its interval holds 0


def test_the_rule_leaves_the_drafter_as_it_is_when_nothing_qualifies():
    cells = _cells(spec=[0.05, -0.01, 0.11], pi=[-0.02, -0.03, -0.01], sinks=None, clamp=[0.01, None, None])
    chosen, reason = choose(cells)
    assert chosen == "none" and "left as it is" in reason


def test_a_gain_exactly_at_zero_does_not_qualify():
    assert choose(_cells(spec=[0.01, 0.0, 0.02]))[0] == "none"


def test_candidates_cover_the_deployments():
    fitted = ScaleSpec(law="log-linear", n_ref=64, slope=0.2, top_k=4)
    names = [a.name for a in candidates(fitted, 64, 64 * 64)]
    assert names[:2] == ["none", "spec"]
    for want in ("slope 0.1", "slope 0.4", "qwen-logn", "sinks", "clamp", "group", "pi", "clamp+spec",
                 "window 32", "window 64", "window 128", "lookup", "lookup+head"):
        assert want in names, (want, names)
    assert len(set(names)) == len(names)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_calibrate import VOCAB, _write_tokenizer

    root = tmp_path_factory.mktemp("select")
    target = tiny_target(0, vocab_size=VOCAB)
    target.save_pretrained(root / "target")
    _write_tokenizer(root / "target")
    head = write_tiny_eagle3(root / "eagle3", target, seed=1, max_position_embeddings=64)
    return {"target": root / "target", "eagle3": head}


def test_select_writes_a_measured_candidate_with_its_record(tmp_path, tiny):
    opts = CalibrateOptions(out=tmp_path / "chosen.json", drafter="eagle3", drafter_path=str(tiny["eagle3"]),
                            target_path=str(tiny["target"]), max_length=256, sequences=3, n_ref=64, device="cpu",
                            bootstrap=20, select=True)
    drafter = load_drafter("eagle3", str(tiny["eagle3"]), str(tiny["target"]), torch.device("cpu"), torch.float32)
    result = run_calibration(opts, drafter=drafter)
    written = json.loads(opts.out.read_text())
    import jsonschema

    jsonschema.validate(written, json.loads(schema_path().read_text()))
    record = written["calibration"]["selection"]
    assert record == result.selection and record["rule"] == RULE
    assert record["buckets"] == [128, 256] and record["sequences"] == 3
    cells = record["candidates"]
    assert {"none", "spec", "window 64", "clamp"} <= set(cells)
    for name, cell in cells.items():
        if name != "none":
            assert set(cell["per_bucket"]) == {"128", "256"}
    assert choose(cells) == (record["chosen"], record["reason"])  # the record explains itself
    spec = ScaleSpec.load(opts.out)
    if record["chosen"] == "none":
        assert spec.law == "constant" and spec.slope == 0.0 and spec.window is None
    else:
        assert cells[record["chosen"]]["gain"]["agreement"][1] > 0
    assert spec.drafter.kind == "eagle3" and spec.calibration.sequences == 3
    from calibrate.evaluate import describe_spec

    if record["chosen"] != "none":  # the file deploys what was measured under that name
        assert describe_spec(spec) == cells[record["chosen"]]["deployment"]
    shown = CliRunner().invoke(app, ["inspect", str(opts.out)], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    assert "deploy " in shown.output and "Candidates on the 3 calibration sequences" in shown.output
    assert shown.output.count("law") >= 1


@pytest.mark.parametrize("kw,match", [
    (dict(drafter="dflash", drafter_path="x"), "--select: the dflash drafter has no teacher-forced pass"),
    (dict(drafter="hf", drafter_path=None), "--select with --drafter hf: give --target-path"),
    (dict(drafter="pard", drafter_path="x"), "--select with --drafter pard: give --target-path"),
])
def test_select_refuses_what_it_cannot_measure(tmp_path, kw, match):
    with pytest.raises(UserError, match=match):
        run_calibration(CalibrateOptions(out=tmp_path / "x.json", select=True, device="cpu", **kw))
    assert not (tmp_path / "x.json").exists()


def test_the_written_spec_is_the_variant_eval_measures(tmp_path, tiny):
    """Whatever wins, the file holds eval's variant of that name (same law, slope, window, positions):
    enable() with it drafts as eval's arm does. Every candidate is checked, not only the winner."""
    from calibrate.evaluate import variant_specs
    from calibrate.measure import slope_arm

    fitted = ScaleSpec(law="log-linear", n_ref=64, slope=0.3, top_k=4)
    for arm in candidates(fitted, 64, 64 * 64):
        if arm.name == "none":
            continue
        if arm.name.startswith("slope "):
            expected = slope_arm(float(arm.name.split()[1]), 64, 4).spec
        elif arm.name.startswith("window "):
            expected = ScaleSpec(law="constant", n_ref=None, slope=0.0, top_k=4, window=int(arm.name.split()[1]))
        else:
            expected = variant_specs(fitted, 64, [arm.name], longest=64 * 64)[arm.name]
        assert arm.spec == expected, arm.name


def test_one_sequence_has_no_interval_so_the_identity_is_written(tmp_path, tiny):
    opts = CalibrateOptions(out=tmp_path / "one.json", drafter="eagle3", drafter_path=str(tiny["eagle3"]),
                            target_path=str(tiny["target"]), max_length=256, sequences=1, n_ref=64, device="cpu",
                            bootstrap=20, select=True)
    drafter = load_drafter("eagle3", str(tiny["eagle3"]), str(tiny["target"]), torch.device("cpu"), torch.float32)
    result = run_calibration(opts, drafter=drafter)
    assert result.selection["chosen"] == "none" and "left as it is" in result.selection["reason"]
    spec = ScaleSpec.load(opts.out)
    assert (spec.law, spec.slope, spec.window, spec.positions) == ("constant", 0.0, None, None)
    assert spec.alpha([64, 4096]).tolist() == [1.0, 1.0]
