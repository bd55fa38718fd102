"""``sharpdraft calibrate --select``: the rule on made-up gains, and the whole run on a tiny EAGLE-3 head."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from calibrate.cli import app
from calibrate.drafters import load_drafter
from calibrate.errors import UserError
from calibrate.run import CalibrateOptions, run_calibration
from calibrate.measure import METRICS, Tally
from calibrate.select import RULE, SIMPLICITY, candidates, choose, decision_line, judge, kind_of
from sharpdraft_theory.spec import ScaleSpec, schema_path

from tiny_checkpoints import tiny_target, write_tiny_eagle3


def _cells(**gains):
    """Candidates' cells with the given agreement gains [mean, lo, hi] (None: not measured), each qualifying
    one's difference from the best by mean as ``choose`` reads it (here: within noise of it)."""
    cells = {"none": {"deployment": None}}
    for name, g in gains.items():
        cells[name] = {"gain": {"agreement": g, "expected_acceptance": g}}
        if g is not None and g[1] is not None and g[1] > 0:
            cells[name]["versus_best"] = [0.0, -0.1, 0.1]
    return cells


def test_the_rule_takes_the_largest_gain_whose_interval_excludes_zero():
    cells = _cells(spec=[0.05, -0.01, 0.11], **{"window 256": [0.03, 0.01, 0.05]}, clamp=[0.02, 0.005, 0.04])
    cells["clamp"]["versus_best"] = [-0.01, -0.02, -0.005]  # below window_256 beyond the noise
    assert choose(cells)[0] == "window 256"  # spec's mean is larger, but its interval holds 0


def test_the_rule_leaves_the_drafter_as_it_is_when_nothing_qualifies():
    cells = _cells(spec=[0.05, -0.01, 0.11], pi=[-0.02, -0.03, -0.01], sinks=None, clamp=[0.01, None, None])
    chosen, reason = choose(cells)
    assert chosen == "none" and "left as it is" in reason


def test_a_gain_exactly_at_zero_does_not_qualify():
    assert choose(_cells(spec=[0.01, 0.0, 0.02]))[0] == "none"


def test_every_candidate_has_a_kind_in_the_simplicity_order():
    fitted = ScaleSpec(law="log-linear", n_ref=64, slope=0.2, top_k=4)
    kinds = {a.name: kind_of(a.name) for a in candidates(fitted, 64, 64 * 64)}
    assert set(kinds.values()) == set(SIMPLICITY)  # every kind is a candidate, lookup and lookup+head included
    assert kinds["spec"] == kinds["slope 0.1"] == kinds["qwen-logn"] == "scale"
    assert (kinds["window 32"], kinds["sinks"], kinds["group"], kinds["pi+spec"]) == ("window", "sinks", "fix",
                                                                                       "fix+scale")
    assert SIMPLICITY.index("lookup") < SIMPLICITY.index("fix") < SIMPLICITY.index("lookup+head")
    with pytest.raises(ValueError, match="no kind in the simplicity order"):
        kind_of("mystery")


def _tallies(gain_window: float, gain_composite: float, seed: int = 0, sequences: int = 8) -> list[Tally]:
    """Made-up tallies over buckets [64, 128, 256] (n_ref 64): 200 rows per sequence and bucket, none agreeing
    on half, ``window 64`` on ``gain_window`` more, ``clamp+spec`` on ``gain_composite`` more, each sequence's
    hits with its own noise of a few rows (a sequence's rows are one sample)."""
    rng = np.random.default_rng(seed)
    rows = np.array([0.0, 200.0, 200.0])
    out = []
    for _ in range(sequences):
        base = 100 + rng.integers(-20, 21, size=3)
        hits = {"none": base, "window 64": base + gain_window * 200 + rng.integers(-6, 7, size=3),
                "clamp+spec": base + gain_composite * 200 + rng.integers(-6, 7, size=3)}
        out.append(Tally(rows=rows, sums={a: {m: np.asarray(h, dtype=float) * (rows > 0) for m in METRICS}
                                          for a, h in hits.items()},
                         mass={a: np.zeros((2, 3)) for a in hits}))
    return out


def _arms(names):
    fitted = ScaleSpec(law="log-linear", n_ref=64, slope=0.2, top_k=4)
    return [a for a in candidates(fitted, 64, 64 * 64) if a.name in names]


def test_within_noise_of_the_best_the_simpler_deployment_is_chosen():
    arms = _arms(("none", "window 64", "clamp+spec"))
    record = judge(_tallies(0.10, 0.11), arms, np.array([64, 128, 256]), 64)
    cells = record["candidates"]
    assert record["best"] == "clamp+spec"  # the larger mean, by a hundredth: noise here
    d = cells["window 64"]["versus_best"]
    assert d[1] <= 0 <= d[2], d  # this test can fail: the made-up noise must leave the difference open
    assert record["chosen"] == "window 64"
    assert "within noise of the best by mean, clamp+spec" in record["reason"] and "simpler" in record["reason"]
    assert cells["clamp+spec"]["versus_best"] == [0.0, 0.0, 0.0]
    assert "best by mean, clamp+spec" in decision_line({**record, "seconds": 1.0})


def test_a_candidate_that_loses_at_n_ref_or_below_does_not_qualify():
    """A window narrower than n_ref can win past n_ref and lose within it: it must not be deployed, and the
    reason names it. The same tallies with no loss within n_ref choose it."""
    rng = np.random.default_rng(1)
    rows = np.array([200.0, 200.0, 200.0])

    def tallies(short_loss):
        out = []
        for _ in range(8):
            base = 100 + rng.integers(-20, 21, size=3)
            window = base + np.array([-short_loss, 0.10, 0.10]) * 200 + rng.integers(-4, 5, size=3)
            spec = base + np.array([0.0, 0.03, 0.03]) * 200 + rng.integers(-4, 5, size=3)
            hits = {"none": base, "window 32": window, "spec": spec}
            out.append(Tally(rows=rows, sums={a: {m: np.asarray(h, dtype=float) for m in METRICS}
                                              for a, h in hits.items()}, mass={a: np.zeros((2, 3)) for a in hits}))
        return out

    arms = _arms(("none", "window 32", "spec"))
    record = judge(tallies(0.08), arms, np.array([64, 128, 256]), 64)
    cells = record["candidates"]
    assert cells["window 32"]["gain"]["agreement"][1] > 0  # it wins past n_ref ...
    assert cells["window 32"]["within_n_ref"]["agreement"][2] < 0  # ... and loses within it
    assert record["chosen"] == "spec" and "window 32 gains past n_ref but loses agreement at n <= n_ref" in \
        record["reason"]
    assert choose(cells) == (record["chosen"], record["reason"])
    assert judge(tallies(0.0), arms, np.array([64, 128, 256]), 64)["chosen"] == "window 32"


def test_the_more_complex_deployment_is_chosen_when_it_wins_beyond_the_noise():
    arms = _arms(("none", "window 64", "clamp+spec"))
    record = judge(_tallies(0.10, 0.25), arms, np.array([64, 128, 256]), 64)
    assert record["best"] == record["chosen"] == "clamp+spec"
    assert record["candidates"]["window 64"]["versus_best"][2] < 0  # excluded: clearly below the best
    assert "every simpler qualifying candidate (window 64) is below it" in record["reason"]


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
    from calibrate.eval.variants import describe_spec

    if record["chosen"] != "none":  # the file deploys what was measured under that name
        assert describe_spec(spec) == cells[record["chosen"]]["deployment"]
    shown = CliRunner().invoke(app, ["inspect", str(opts.out)], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    assert "deploy " in shown.output and "Candidates on the 3 calibration sequences" in shown.output
    assert shown.output.count("law") >= 1


@pytest.mark.parametrize("kw,match", [
    (dict(drafter="hf", drafter_path=None), "--select with --drafter hf: give --target-path"),
    (dict(drafter="pard", drafter_path="x"), "--select with --drafter pard: give --target-path"),
])
def test_select_refuses_what_it_cannot_measure(tmp_path, kw, match):
    with pytest.raises(UserError, match=match):
        run_calibration(CalibrateOptions(out=tmp_path / "x.json", select=True, device="cpu", **kw))
    assert not (tmp_path / "x.json").exists()


def test_a_drafter_cut_from_smollm2_selects_against_smollm2_by_default(tmp_path):
    """Its config names SmolLM2 as its embedding's source, so SmolLM2 is its target: --select needs no
    --target-path (the run then fails on this folder's missing weights, after the check passed)."""
    folder = tmp_path / "cut"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "sharpdraft_embedding_from": "smollm2"}))
    with pytest.raises(UserError, match="no model.safetensors"):
        run_calibration(CalibrateOptions(out=tmp_path / "x.json", select=True, device="cpu", drafter="pard",
                                         drafter_path=str(folder), corpus="pydoc", sequences=1, max_length=256))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "sharpdraft_embedding_from": "/elsewhere"}))
    with pytest.raises(UserError, match="give --target-path"):
        run_calibration(CalibrateOptions(out=tmp_path / "x.json", select=True, device="cpu", drafter="pard",
                                         drafter_path=str(folder)))


def test_the_written_spec_is_the_variant_eval_measures(tmp_path, tiny):
    """Whatever wins, the file holds eval's variant of that name (same law, slope, window, positions):
    enable() with it drafts as eval's arm does. Every candidate is checked, not only the winner."""
    from calibrate.eval.variants import variant_specs
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


WINDOW = 32  # the target's sliding window, the drafter's n_ref: ``window 32`` makes the drafter the target


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A drafter for which a window really wins: a tiny Llama (full attention) and, as the target, the same
    weights as a Mistral with a sliding window of ``WINDOW`` keys. Deployed with ``window 32`` the drafter is
    the target; every other candidate leaves it attending to keys the target no longer sees."""
    from test_calibrate import VOCAB, _write_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    root = tmp_path_factory.mktemp("windowed")
    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        drafter = LlamaForCausalLM(LlamaConfig(**shape))
    target = MistralForCausalLM(MistralConfig(sliding_window=WINDOW, **shape))
    target.load_state_dict(drafter.state_dict())
    for name, model in (("drafter", drafter), ("target", target)):
        model.save_pretrained(root / name)
        _write_tokenizer(root / name)
    return {"drafter": str(root / "drafter"), "target": str(root / "target"), "root": root}


def _windowed_args(windowed, out):
    return ["calibrate", "--drafter", "hf", "--drafter-path", windowed["drafter"], "--target-path", windowed["target"],
            "--max-length", "128", "--sequences", "3", "--n-ref", str(WINDOW), "--device", "cpu", "--select",
            "--out", str(out)]


def test_a_window_wins_end_to_end_through_the_cli(windowed, tmp_path):
    """The crash of a winner without n_ref: calibrate --select, its summary and inspect, exit 0 each."""
    out = tmp_path / "w.json"
    done = CliRunner().invoke(app, _windowed_args(windowed, out), terminal_width=200)
    assert done.exit_code == 0, done.output
    spec = ScaleSpec.load(out)
    record = spec.calibration.selection
    assert record["chosen"] == f"window {WINDOW}" and spec.window == WINDOW and spec.n_ref is None
    text = " ".join(done.output.split())  # the console wraps at its own width
    assert f"deploy window {WINDOW}:" in text and f"w.json: window {WINDOW}, the deployment --select chose" in text
    assert f"Why: window {WINDOW}: the largest agreement gain whose interval excludes 0" in text
    shown = CliRunner().invoke(app, ["inspect", str(out)], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    assert f"deploy window {WINDOW}:" in shown.output


def test_every_kind_of_candidate_goes_through_summary_inspect_and_enable(windowed, tmp_path):
    """Each candidate --select can write, as the file it would write: the calibrate summary, inspect, and
    enable() on the drafter, which then drafts as the measured arm did (the file deploys what was measured)."""
    from dataclasses import replace

    from calibrate import calibrate_cmd
    from calibrate.select import deployed
    from calibrate.taps import ScalingTap, attention_tap
    from sharpdraft_runtime import disable, enable

    opts = CalibrateOptions(out=tmp_path / "fit.json", drafter="hf", drafter_path=windowed["drafter"],
                            target_path=windowed["target"], max_length=128, sequences=3, n_ref=WINDOW, device="cpu",
                            bootstrap=20, select=True)
    drafter = load_drafter("hf", windowed["drafter"], windowed["target"], torch.device("cpu"), torch.float32)
    result = run_calibration(opts, drafter=drafter)
    ids = torch.tensor([drafter.tokenize("def f(x):\n    return x * 2\n" * 6)[:128]])
    with torch.no_grad():
        plain = drafter.model(input_ids=ids, use_cache=False).logits
    kinds = set()
    for arm in candidates(result.fitted, WINDOW, 64 * WINDOW):
        kinds.add(kind_of(arm.name))
        spec = deployed(result.fitted, arm.spec, {**result.selection, "chosen": arm.name})
        with calibrate_cmd.console.capture() as captured:
            calibrate_cmd._summary(replace(result, spec=spec, selection=spec.calibration.selection), opts.out)
        assert f"deploy {arm.name}" in captured.get(), arm.name
        spec.save(tmp_path / "s.json")
        shown = CliRunner().invoke(app, ["inspect", str(tmp_path / "s.json")], terminal_width=200)
        assert shown.exit_code == 0, (arm.name, shown.output)
        with torch.no_grad():
            with attention_tap(drafter.model, ScalingTap(arm.spec), restrict=arm.spec):
                measured = drafter.model(input_ids=ids, use_cache=False).logits
            enable(drafter.model, spec)
            try:
                deployed_logits = drafter.model(input_ids=ids, use_cache=False).logits
            finally:
                disable(drafter.model)
        # float32 through two routes to the same attention: a few ulps of logits of size ~10
        torch.testing.assert_close(deployed_logits, measured, atol=1e-4, rtol=1e-4, msg=arm.name)
        if arm.name != "none" and arm.drafts == "head":  # this test can fail: a deployment that changed nothing
            assert not torch.allclose(deployed_logits, plain, atol=1e-3), arm.name  # would pass the above
        elif arm.drafts != "head":  # lookup runs in the serving engine; the file leaves the drafter as it is
            assert spec.law == "constant" and spec.window is None and spec.positions is None, arm.name
    assert kinds == set(SIMPLICITY)
