"""`sharpdraft predict` and `sharpdraft inspect`, through typer's runner and the console script."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from calibrate.cli import app
from sharpdraft_theory import ScaleSpec

runner = CliRunner()


def run_main(*args):
    """The console script's entry point, in a subprocess: what a user sees, exit code included."""
    return subprocess.run([sys.executable, "-c", "from calibrate.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=120)


def test_predict_json_has_the_documented_keys():
    res = runner.invoke(app, ["predict", "--model", "gaussian", "--gap", "6", "--sigma", "1", "--top-k", "4",
                              "--n-ref", "512", "--n", "4096", "--n", "65536", "--n", "1000000000", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert {"mass_ref", "beta_tangent", "horizon_n", "rows"} <= set(out)
    assert out["beta_tangent"] == pytest.approx(0.2)
    assert out["horizon_n"] == pytest.approx(1.363e8, rel=1e-3)
    keys = {"n", "mass_unscaled", "alpha_exact", "alpha_fixed_slope", "mass_exact", "mass_fixed_slope", "regime"}
    for row in out["rows"]:
        assert keys <= set(row)
    first, _, past = out["rows"]
    assert first["mass_exact"] == pytest.approx(out["mass_ref"], rel=1e-9)
    assert first["mass_unscaled"] < out["mass_ref"]
    assert past["alpha_exact"] is None and "horizon" in past["note"]


def test_predict_monte_carlo_and_two_level_table():
    res = runner.invoke(app, ["predict", "--model", "two-level", "--gap", "5", "--n", "2048", "--mc-rows", "20"])
    assert res.exit_code == 0, res.output
    assert "monte-carlo" in res.output and "none (any length can be restored)" in res.output


@pytest.mark.parametrize("args,message", [
    (["--model", "gaussian", "--gap", "0.5", "--sigma", "1"], "--gap 0.5 must exceed sigma^2 = 1"),
    (["--top-k", "8", "--n-ref", "8"], "--n-ref 8: must exceed --top-k 8"),
    (["--n", "3"], "--n 3: must exceed --top-k 4"),
    (["--model", "cauchy"], "--model 'cauchy' is not known"),
    (["--model", "two-level", "--sigma", "1"], "--sigma applies to --model gaussian only"),
    (["--n", "100000000", "--mc-rows", "5"], "too long for --mc-rows"),
])
def test_predict_bad_input_is_one_line_exit_1(args, message):
    res = run_main("predict", *args)
    assert res.returncode == 1
    assert message in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_inspect_shows_a_spec(tmp_path):
    path = tmp_path / "s.json"
    ScaleSpec(law="log-linear", n_ref=256, slope=[0.1, 0.3], top_k=4, granularity="layer").save(path)
    res = runner.invoke(app, ["inspect", str(path)])
    assert res.exit_code == 0, res.output
    assert "log-linear" in res.output and "layer: shape (2,)" in res.output and "1024:" in res.output


def test_inspect_bad_spec_is_one_line_exit_1(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"law": "log-linear", "n_ref": 256, "slope": "steep", "top_k": 4}))
    res = run_main("inspect", str(path))
    assert res.returncode == 1
    assert "spec field 'slope': expected a finite number" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    missing = run_main("inspect", str(tmp_path / "missing.json"))
    assert missing.returncode == 1 and "cannot read it" in missing.stderr


def _sparse_selection(**over) -> dict:
    """A ``calibrate --select`` record with only what the validator requires: gains holding the metric alone,
    no ``within_n_ref``, no ``versus_best``."""
    def only(g):
        return {"agreement": g}

    return {"rule": "r", "simplicity": ["none", "scale", "fix"], "metric": "agreement", "weights": "equal",
            "sequences": 2, "buckets": [128, 256], "seconds": 1.0, "best": "spec", "chosen": "spec",
            "reason": "spec: best", "candidates": {
                "none": {"deployment": None},
                "spec": {"deployment": None, "gain": only([0.02, 0.01, 0.03]),
                         "per_bucket": {"128": only(None), "256": only([0.03, 0.01, 0.05])}}}, **over}


def _mixed_selection() -> dict:
    """One candidate with every optional gain, one with none of them."""
    record = _sparse_selection()
    full = {"agreement": [0.01, -0.01, 0.02], "expected_acceptance": [0.005, 0.0, 0.01]}
    record["candidates"]["clamp"] = {"deployment": {"positions": "clamp"}, "gain": full, "within_n_ref": full,
                                     "per_bucket": {"128": full, "256": full}, "versus_best": [-0.01, -0.02, 0.0]}
    return record


@pytest.mark.parametrize("record,shown", [
    (_sparse_selection(), "deploy spec: +0.030 [+0.010, +0.050] agreement at 256"),
    (_sparse_selection(best=None), "deploy spec: +0.030 [+0.010, +0.050] agreement at 256"),
    (_sparse_selection(best=None, chosen="none"), "deploy none"),
    (_mixed_selection(), "+0.0050"),  # clamp's expected acceptance: the column a candidate lacks shows -
], ids=["gains-metric-only", "no-best", "none-chosen", "optional-gains-on-one"])
def test_inspect_shows_every_selection_record_the_validator_accepts(tmp_path, record, shown):
    """inspect indexes only what the validator requires of a selection record; what a record lacks shows as -."""
    import jsonschema

    from sharpdraft_theory.spec import schema_path

    spec = {"law": "log-linear", "n_ref": 64, "slope": 0.2, "top_k": 4, "calibration": {
        "estimator": "mass-matching", "corpus": "pydoc", "sequences": 2, "max_length": 256, "rows": 10, "buckets": [],
        "results": [], "tool_version": "0.1.0", "selection": record}}
    jsonschema.validate(spec, json.loads(schema_path().read_text()))
    ScaleSpec.from_dict(spec).save(tmp_path / "s.json")
    res = runner.invoke(app, ["inspect", str(tmp_path / "s.json")], terminal_width=200)
    assert res.exit_code == 0, res.output
    assert shown in res.output


def test_theory_imports_without_torch():
    code = "import sys, sharpdraft_theory, sharpdraft_theory.estimators; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
