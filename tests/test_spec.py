"""The scale spec: round trips, validation that names the field, and the shipped JSON Schema in sync."""

import copy
import json
from dataclasses import fields

import jsonschema
import numpy as np
import pytest

from sharpdraft_theory import SCHEMA, Bucket, Calibration, DrafterInfo, EstimatorResult, ScaleSpec, SpecError
from sharpdraft_theory.estimators import ESTIMATORS
from sharpdraft_theory.laws import LAWS, REGISTRY
from sharpdraft_theory.positions import FIXES, PositionFix
from sharpdraft_theory.spec import CANDIDATE_FIELDS, DRAFTER_KIND_PATTERN, SELECTION_FIELDS, AlphaTable, schema_path


def full_spec(**over) -> ScaleSpec:
    kw = dict(
        law="log-linear", n_ref=256, slope=[[0.1, 0.2, 0.3], [0.0, 0.1, 0.2]], top_k=4, granularity="head",
        alpha_max=3.0,
        drafter=DrafterInfo(kind="eagle3", path="/ckpt", num_layers=2, num_heads=3, num_kv_heads=1, head_dim=16),
        calibration=Calibration(
            estimator="mass-matching", corpus="pydoc", sequences=4, max_length=2048, rows=1000,
            buckets=(Bucket(n=300.5, rows=10, mass=0.4, alpha=1.1), Bucket(n=128.0, rows=5, mass=0.6, alpha=None)),
            results=(EstimatorResult("mass-matching", 0.2, 0.18, 0.22, {"r2": 0.98}),
                     EstimatorResult("gaussian", None, None, None, {}, "tbar - mu - sigma^2 <= 0")),
            tool_version="0.1.0"),
    )
    kw.update(over)
    return ScaleSpec(**kw)


def tabulated_spec(**over) -> ScaleSpec:
    """``full_spec`` with a per-head table in place of the slopes: knots past n_ref = 256, values > 0."""
    table = AlphaTable(n=(362, 512, 2048), alpha=(((1.1, 1.2, 1.5), (1.0, 1.0, 1.0), (0.9, 1.3, 2.5)),
                                                  ((1.05, 1.1, 1.3), (1.2, 1.4, 1.4), (1.0, 1.1, 1.2))),
                       measured=2, extrapolation="fixed-slope")
    return full_spec(**{"law": "tabulated", "slope": None, "table": table, **over})


def _selection() -> dict:
    """A ``calibrate --select`` record of two candidates over buckets 512 and 1024 (as ``calibrate.select.judge``
    writes it, with its seconds)."""
    def gains(g):
        return {"agreement": g, "expected_acceptance": g}

    return {"rule": "the rule", "simplicity": ["none", "scale", "window"], "metric": "agreement", "weights": "equal",
            "sequences": 4, "buckets": [512, 1024], "seconds": 12.5,
            "candidates": {"none": {"deployment": None},
                           "spec": {"deployment": {"law": "log-linear"}, "gain": gains([0.02, 0.01, 0.03]),
                                    "per_bucket": {"512": gains([0.01, None, None]), "1024": gains(None)},
                                    "versus_best": [0.0, 0.0, 0.0]}},
            "best": "spec", "chosen": "spec", "reason": "spec: the largest agreement gain whose interval excludes 0"}


def selected_spec(**over) -> ScaleSpec:
    """``full_spec`` with a selection record in its calibration."""
    spec = full_spec()
    return full_spec(calibration=Calibration(**{**spec.calibration.__dict__, "selection": _selection()}), **over)


# A table for a spec with n_ref = 64, as each law's parameter test needs one.
TABLE_64 = {"n": [96, 128], "alpha": [1.1, 1.3]}


@pytest.fixture(scope="module")
def schema():
    return json.loads(schema_path().read_text())


def test_a_selection_record_round_trips_and_passes_the_schema(schema):
    spec = selected_spec()
    assert ScaleSpec.from_json(spec.to_json()) == spec
    jsonschema.validate(spec.to_dict(), schema)


def test_round_trip_through_json_and_file(tmp_path):
    assert ScaleSpec.from_json(full_spec(window=60, sinks=4).to_json()).sinks == 4
    spec = full_spec()
    assert ScaleSpec.from_json(spec.to_json()) == spec
    spec.save(tmp_path / "s.json")
    assert ScaleSpec.load(tmp_path / "s.json") == spec
    assert json.loads((tmp_path / "s.json").read_text())["schema"] == SCHEMA
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]  # no temp file left behind


def test_tabulated_round_trip_and_alpha(tmp_path):
    spec = tabulated_spec()
    spec.save(tmp_path / "t.json")
    assert ScaleSpec.load(tmp_path / "t.json") == spec
    assert spec.shape() == (2, 3) and spec.values().shape == (2, 3, 3) and spec.slopes() is None
    a = spec.alpha([100, 256, 362, 512, 1024, 2048, 10**6], layer=1)  # (7, heads)
    # n <= n_ref: 1; at a knot: its value; between knots: linear in ln n; past the last: held.
    np.testing.assert_array_equal(a[:2], 1.0)
    np.testing.assert_allclose(a[2:4], [[1.05, 1.2, 1.0], [1.1, 1.4, 1.1]], rtol=1e-14)
    np.testing.assert_allclose(a[4], [1.1 + 0.2 * 0.5, 1.4, 1.1 + 0.1 * 0.5], rtol=1e-14)  # 1024 halfway in ln n
    np.testing.assert_allclose(a[5:], [[1.3, 1.4, 1.2]] * 2, rtol=1e-14)
    assert spec.identity_limit() == 256
    flat = tabulated_spec(table=AlphaTable(n=(300,), alpha=(((1.0,) * 1,) * 3,) * 2))
    assert flat.identity_limit() == float("inf")


def test_alpha_per_layer_and_head():
    spec = full_spec()
    a = spec.alpha([256, 512], layer=1)
    assert a.shape == (2, 3)
    np.testing.assert_allclose(a[1], 1 + np.array([0.0, 0.1, 0.2]) * np.log(2), rtol=1e-14)
    with pytest.raises(ValueError, match="pass layer="):
        spec.alpha([512])


def test_valid_specs_pass_the_schema(schema):
    for spec in (full_spec(), ScaleSpec(law="qwen-logn", n_ref=64, slope=None, top_k=1),
                 ScaleSpec(law="ssmax", n_ref=None, slope=0.3, top_k=2),
                 ScaleSpec(law="log-linear", n_ref=512, slope=[0.1, 0.2], top_k=4, granularity="layer"),
                 ScaleSpec(law="constant", n_ref=None, slope=0.0, top_k=4, window=256),
                 full_spec(window=252, sinks=4), tabulated_spec(),
                 *(full_spec(positions=fix) for fix in (PositionFix("clamp", window=255),
                                                        PositionFix("group", window=128, group=16),
                                                        PositionFix("pi", n_ref=256),
                                                        PositionFix("pi", n_ref=128))),
                 ScaleSpec(law="tabulated", n_ref=64, slope=None, top_k=4, table=AlphaTable(**TABLE_64)),
                 ScaleSpec(law="tabulated", n_ref=64, slope=None, top_k=4, granularity="layer",
                           table=AlphaTable(n=(128,), alpha=((1.2,), (1.3,))))):
        jsonschema.validate(spec.to_dict(), schema)


def test_schema_names_every_dataclass_field(schema):
    """The schema and the dataclasses must describe the same fields (keeps them in sync)."""
    assert set(schema["properties"]) == {f.name for f in fields(ScaleSpec)}
    drafter = schema["properties"]["drafter"]["anyOf"][1]
    calibration = schema["properties"]["calibration"]["anyOf"][1]
    assert set(drafter["properties"]) == {f.name for f in fields(DrafterInfo)}
    assert set(calibration["properties"]) == {f.name for f in fields(Calibration)}
    assert set(calibration["properties"]["buckets"]["items"]["properties"]) == {f.name for f in fields(Bucket)}
    assert set(calibration["properties"]["results"]["items"]["properties"]) == {f.name for f in fields(EstimatorResult)}
    positions = schema["properties"]["positions"]["anyOf"][1]
    assert set(positions["properties"]) == {f.name for f in fields(PositionFix)}
    assert set(positions["properties"]["fix"]["enum"]) == set(FIXES)
    selection = calibration["properties"]["selection"]["anyOf"][1]
    assert set(selection["properties"]) == set(selection["required"]) == set(SELECTION_FIELDS)
    assert set(selection["properties"]["candidates"]["additionalProperties"]["properties"]) == set(CANDIDATE_FIELDS)
    table = schema["properties"]["table"]["anyOf"][1]
    assert set(table["properties"]) == {f.name for f in fields(AlphaTable)}
    assert set(table["required"]) == {f.name for f in fields(AlphaTable) if f.default is f.default_factory}
    required = {f.name for f in fields(ScaleSpec) if f.default is f.default_factory}  # no default: required
    assert set(schema["required"]) == required


def _set(d, path, value):
    d = copy.deepcopy(d)
    node = d
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


class _Deleted:
    """Marks a field to delete; its repr is stable, so test ids match across parallel workers."""

    def __repr__(self):
        return "<deleted>"


_DELETE = _Deleted()

# (path to change, new value, field the error must name, fragment of the message). Each case is
# rejected by the loader; `schema_too` says whether the JSON Schema alone can see it (the rest
# are cross-field rules listed in the schema's description).
MALFORMED = [
    (("law",), "logn", "law", "expected one of", True),
    (("schema",), "sharpdraft.scale-spec/v2", "schema", "v1 specs only", True),
    (("n_ref",), -3, "n_ref", "expected an integer >= 2", True),
    (("n_ref",), 3, "n_ref", "must exceed top_k=4", False),
    (("n_ref",), "256", "n_ref", "expected an integer", True),
    (("top_k",), 0, "top_k", "expected an integer >= 1", True),
    (("top_k",), _DELETE, "top_k", "required field is missing", True),
    (("slope",), 0.2, "slope", "granularity 'head' needs a non-empty list", True),
    (("slope",), [[0.1, 0.2, 0.3], [0.1]], "slope", "same number of head slopes", False),
    (("slope",), [[0.1, "x", 0.3], [0.0, 0.1, 0.2]], "slope[0][1]", "expected a finite number", True),
    (("granularity",), "tensor", "granularity", "expected one of", True),
    (("alpha_max",), 0.0, "alpha_max", "expected a number > 0", True),
    (("alpha_max",), 0.5, "alpha_max", "log-linear needs alpha_max >= 1", False),
    (("drafter", "kind"), "", "drafter.kind", "expected a lowercase identifier", True),
    (("drafter", "kind"), "Eagle 3", "drafter.kind", "expected a lowercase identifier", True),
    (("drafter", "kind"), 3, "drafter.kind", "expected a lowercase identifier", True),
    (("drafter", "num_kv_heads"), 2, "drafter.num_kv_heads", "must divide num_heads=3", False),
    (("drafter", "num_layers"), 5, "slope", "one entry per layer (5)", False),
    (("calibration", "buckets", 0, "mass"), 1.5, "calibration.buckets[0].mass", "mass in [0, 1]", True),
    (("calibration", "results", 0, "estimator"), "magic", "calibration.results[0].estimator", "expected one of",
     True),
    (("calibration", "rows"), _DELETE, "calibration.rows", "required field is missing", True),
    (("extra_field",), 1, "extra_field", "unknown field", True),
    (("window",), 0, "window", "expected an integer >= 1", True),
    (("window",), 2.5, "window", "expected an integer", True),
    (("window",), "256", "window", "expected an integer", True),
    (("sinks",), -1, "sinks", "expected an integer >= 1", True),
    (("sinks",), True, "sinks", "expected an integer", True),
    (("sinks",), 4, "sinks", "set window too", True),
    (("slope",), [[0.1, -0.2, 0.3], [0.0, 0.1, 0.2]], "slope", "alpha must stay > 0", True),
    (("slope",), [[0.1, 1e38, 0.3], [0.0, 0.1, 0.2]], "slope", "alpha must stay finite", False),
    (("n_ref",), 2**32 + 1, "n_ref", "expected an integer <= 4294967296", True),
    (("positions",), {"fix": "rope"}, "positions.fix", "expected one of clamp, group, pi", True),
    (("positions",), {"fix": "clamp"}, "positions.window", "clamp needs it", True),
    (("positions",), {"fix": "clamp", "window": 0}, "positions.window", "expected an integer >= 1", True),
    (("positions",), {"fix": "clamp", "window": 2.5}, "positions.window", "expected an integer", True),
    (("positions",), {"fix": "clamp", "window": 8, "group": 2}, "positions.group", "clamp takes window only", True),
    (("positions",), {"fix": "group", "window": 8}, "positions.group", "group needs it", True),
    (("positions",), {"fix": "group", "window": 8, "group": 1}, "positions.group", "expected an integer >= 2", True),
    (("positions",), {"fix": "pi", "n_ref": 1}, "positions.n_ref", "expected an integer >= 2", True),
    (("positions",), {"fix": "pi", "n_ref": 64, "window": 8}, "positions.window", "pi takes n_ref only", True),
    (("positions",), {"fix": "pi", "n_ref": 64, "scale": 2}, "positions.scale", "unknown field", True),
    (("positions",), 3, "positions", "expected an object", True),
    # pi leaves rows up to its own n_ref as they are: past the spec's (256) that keeps untrained distances
    (("positions",), {"fix": "pi", "n_ref": 2**31}, "positions.n_ref", "must be at most n_ref=256", False),
    (("positions",), {"fix": "pi", "n_ref": 257}, "positions.n_ref", "write 256", False),
]


# The same, on a tabulated spec (``tabulated_spec``: n_ref 256, 2 layers x 3 heads x 3 knots).
MALFORMED_TABULATED = [
    (("table",), None, "table", "tabulated needs a table", True),
    (("slope",), 0.2, "slope", "tabulated has no slope", True),
    (("table", "n"), [], "table.n", "non-empty list of knots", True),
    (("table", "n"), [256, 512, 2048], "table.n[0]", "knots lie past n_ref=256", False),
    (("table", "n"), [362, 362, 2048], "table.n[1]", "knots must increase strictly", False),
    (("table", "n"), [362, 300, 2048], "table.n[1]", "knots must increase strictly", False),
    (("table", "n"), [362, 512.5, 2048], "table.n[1]", "expected an integer", True),
    (("table", "n"), [362, 2048], "table.alpha[0][0]", "one value per knot (2)", False),
    (("table", "alpha", 0, 0, 1), 0.0, "table.alpha[0][0][1]", "expected a number > 0", True),
    (("table", "alpha", 0, 0, 1), -1.5, "table.alpha[0][0][1]", "expected a number > 0", True),
    (("table", "alpha", 0, 0, 1), "1.2", "table.alpha[0][0][1]", "expected a finite number", True),
    (("table", "alpha", 0, 0, 1), 1e39, "table.alpha[0][0][1]", "finite in float32", False),
    (("table", "alpha", 1), [[1.0, 1.0, 1.0]], "table.alpha", "same number of heads", False),
    (("table", "alpha"), [1.1, 1.2, 1.3], "table.alpha[0]", "expected a non-empty list", True),
    (("table", "measured"), 4, "table.measured", "at most the 3 knots", False),
    (("table", "extra"), 1, "table.extra", "unknown field", True),
    (("table", "alpha"), _DELETE, "table.alpha", "required field is missing", True),
    (("drafter", "num_heads"), 6, "table.alpha[0]", "one entry per head (6)", False),
]
# The same, on a spec with a selection record (``selected_spec``): what `inspect` and the summary read.
_S = ("calibration", "selection")
MALFORMED_SELECTION = [
    (_S, {"chosen": "none", "candidates": {"none": {}}}, "calibration.selection.rule", "required field is missing",
     True),
    (_S, [], "calibration.selection", "expected an object", True),
    (_S + ("buckets",), [], "calibration.selection.buckets", "non-empty list of bucket lengths", True),
    (_S + ("buckets", 0), 512.5, "calibration.selection.buckets[0]", "expected an integer", True),
    (_S + ("sequences",), -1, "calibration.selection.sequences", "expected an integer >= 0", True),
    (_S + ("seconds",), "fast", "calibration.selection.seconds", "expected a finite number", True),
    (_S + ("simplicity",), [], "calibration.selection.simplicity", "non-empty list of kinds", True),
    (_S + ("reason",), None, "calibration.selection.reason", "expected a string", True),
    (_S + ("extra",), 1, "calibration.selection.extra", "unknown field", True),
    (_S + ("chosen",), "window", "calibration.selection.chosen", "one of its candidates", False),
    (_S + ("best",), "window", "calibration.selection.best", "one of its candidates", False),
    (_S + ("candidates",), {}, "calibration.selection.candidates", "none among them", True),
    (_S + ("candidates", "spec", "gain", "agreement"), "0.02", "calibration.selection.candidates.spec.gain.agreement",
     "expected [mean, lo, hi] or null", True),
    (_S + ("candidates", "spec", "gain", "agreement"), [0.02, float("nan"), 0.03],
     "calibration.selection.candidates.spec.gain.agreement[1]", "expected a finite number", False),
    (_S + ("candidates", "spec", "gain", "agreement"), [0.02, None, 0.03],
     "calibration.selection.candidates.spec.gain.agreement", "both bounds or neither", False),
    (_S + ("candidates", "spec", "gain"), {"expected_acceptance": None}, "calibration.selection.candidates.spec.gain",
     "gains with agreement", True),
    (_S + ("candidates", "spec", "per_bucket"), {}, "calibration.selection.candidates.spec.per_bucket",
     "one entry per bucket (512, 1024)", False),
    (_S + ("candidates", "spec", "per_bucket", "512", "agreement"), [0.1, 0.2],
     "calibration.selection.candidates.spec.per_bucket.512.agreement", "expected [mean, lo, hi] or null", True),
    (_S + ("candidates", "spec", "versus_best"), [float("inf"), 0.0, 0.0],
     "calibration.selection.candidates.spec.versus_best[0]", "expected a finite number", False),
    (_S + ("candidates", "spec", "gain"), _DELETE, "calibration.selection.candidates.spec.gain",
     "required field is missing", False),
    (_S + ("candidates", "none"), "x", "calibration.selection.candidates.none", "expected an object", True),
    # what a reader indexes: the rule's metric, a best with gains, none without any of its own
    (_S + ("metric",), "expected_acceptance", "calibration.selection.metric", "expected one of agreement", True),
    (_S + ("best",), "none", "calibration.selection.best", "but none", True),
    (_S + ("candidates", "none", "gain"), {"agreement": [0.0, 0.0, 0.0]},
     "calibration.selection.candidates.none.gain", "unknown field (known: deployment)", True),
]
CASES = ([(full_spec, m) for m in MALFORMED] + [(tabulated_spec, m) for m in MALFORMED_TABULATED]
         + [(selected_spec, m) for m in MALFORMED_SELECTION])


@pytest.mark.parametrize("base,case", CASES,
                         ids=[f"{b.__name__[:4]}:{'.'.join(map(str, m[0]))}={m[1]!r}"[:45] for b, m in CASES])
def test_malformed_spec_is_rejected_naming_the_field(schema, base, case):
    path, value, field, fragment, schema_too = case
    bad = _set(base().to_dict(), path, value)
    with pytest.raises(ValueError) as err:
        ScaleSpec.from_dict(bad)
    assert f"spec field '{field}'" in str(err.value)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)
    if schema_too:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def _law_conditions(schema) -> list[dict]:
    return [e for e in schema["allOf"] if "law" in e["if"].get("properties", {})]


def _law_condition(schema, then_property: str) -> dict:
    """The ``allOf`` entry whose ``if`` picks laws and whose ``then`` constrains ``then_property``'s type."""
    (entry,) = [e for e in _law_conditions(schema) if "type" in e["then"]["properties"].get(then_property, {})]
    return entry


def _slope_floor(schema, law: str) -> tuple[float, bool]:
    """The schema's least slope for ``law``: (value, exclusive)."""
    (floor,) = [e["then"]["properties"]["slope"] for e in _law_conditions(schema)
                if law in e["if"]["properties"]["law"]["enum"]
                and "type" not in e["then"]["properties"].get("slope", {"type": None})]
    return (floor["exclusiveMinimum"], True) if "exclusiveMinimum" in floor else (floor["minimum"], False)


@pytest.mark.parametrize("law", [law for law in LAWS if REGISTRY[law].has_slope])
def test_schema_slope_floor_is_the_registry_contract(schema, law):
    """alpha > 0 for 2 <= n <= 2^32: the loader (Law.bounds) and the schema's per-law minimum draw one line."""
    floor, exclusive = _slope_floor(schema, law)
    eps = 1e-6
    for slope, legal in ((floor - eps, False), (floor, not exclusive), (floor + eps, True), (floor + 1.0, True)):
        spec = {"law": law, "n_ref": 64, "slope": [[slope, 0.5]], "top_k": 4, "granularity": "head"}
        if legal:
            ScaleSpec.from_dict(spec)
            jsonschema.validate(spec, schema)
            continue
        with pytest.raises(ValueError, match="alpha must stay > 0"):
            ScaleSpec.from_dict(spec)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(spec, schema)


def test_spec_checks_the_model_shape():
    spec = full_spec()  # 2 layers x 3 heads
    spec.check_fits(2, 3)
    for layers, heads, fragment in ((2, 4, "2 layers x 3 heads, the model has 2 layers x 4 heads"),
                                    (5, 3, "the model has 5 layers x 3 heads")):
        with pytest.raises(ValueError, match=fragment):
            spec.check_fits(layers, heads)


def test_schema_enums_equal_the_registries(schema):
    """Adding a law or an estimator is one registry entry plus these schema lines; this keeps them equal."""
    assert schema["properties"]["law"]["enum"] == list(LAWS)
    needs_n_ref = _law_condition(schema, "n_ref")
    assert needs_n_ref["if"]["properties"]["law"]["enum"] == [law.name for law in REGISTRY.values() if law.needs_n_ref]
    no_slope = _law_condition(schema, "slope")
    assert no_slope["if"]["properties"]["law"]["enum"] == [law.name for law in REGISTRY.values() if not law.has_slope]
    assert no_slope["then"]["properties"]["slope"] == {"type": "null"}
    table = _law_condition(schema, "table")
    assert table["if"]["properties"]["law"]["enum"] == [law.name for law in REGISTRY.values() if law.has_table]
    calibration = schema["properties"]["calibration"]["anyOf"][1]["properties"]
    assert calibration["estimator"]["enum"] == list(ESTIMATORS)
    assert calibration["results"]["items"]["properties"]["estimator"]["enum"] == list(ESTIMATORS)
    assert schema["properties"]["drafter"]["anyOf"][1]["properties"]["kind"]["pattern"] == DRAFTER_KIND_PATTERN


@pytest.mark.parametrize("law", LAWS)
def test_each_law_takes_the_parameters_its_registry_entry_says(schema, law):
    """n_ref may be null and slope must be null exactly as the registry says, for the loader and the schema."""
    entry = REGISTRY[law]
    slope = 0.2 if entry.has_slope else None
    ok = {"law": law, "n_ref": 64, "slope": slope, "top_k": 4, **({"table": TABLE_64} if entry.has_table else {})}
    ScaleSpec.from_dict(ok)
    jsonschema.validate(ok, schema)
    for change, valid in (({"n_ref": None}, not entry.needs_n_ref), ({"slope": 0.3 if slope is None else None}, False),
                          ({"table": None if entry.has_table else TABLE_64}, False)):
        bad = {**ok, **change}
        if valid:
            ScaleSpec.from_dict(bad)
            jsonschema.validate(bad, schema)
            continue
        with pytest.raises(ValueError, match=f"spec field '{next(iter(change))}'"):
            ScaleSpec.from_dict(bad)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    if entry.min_alpha_max > 0:
        with pytest.raises(ValueError, match=f"{law} needs alpha_max >= "):
            ScaleSpec.from_dict({**ok, "alpha_max": entry.min_alpha_max / 2})


def test_any_drafter_kind_identifier_is_accepted(schema):
    """Which kinds exist is calibrate's business: the spec takes any lowercase identifier."""
    spec = full_spec(drafter=DrafterInfo(kind="medusa-2", path=None, num_layers=2, num_heads=3, num_kv_heads=1,
                                         head_dim=16))
    assert ScaleSpec.from_json(spec.to_json()).drafter.kind == "medusa-2"
    jsonschema.validate(spec.to_dict(), schema)


def test_law_specific_rules(schema):
    with pytest.raises(ValueError, match="spec field 'slope': qwen-logn has no slope"):
        ScaleSpec(law="qwen-logn", n_ref=64, slope=0.1, top_k=1)
    with pytest.raises(ValueError, match="spec field 'n_ref': expected an integer"):
        ScaleSpec(law="log-linear", n_ref=None, slope=0.1, top_k=1)
    for bad in ({"law": "qwen-logn", "n_ref": 64, "slope": 0.1, "top_k": 1},
                {"law": "log-linear", "n_ref": None, "slope": 0.1, "top_k": 1}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_unreadable_and_non_json_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read it"):
        ScaleSpec.load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ScaleSpec.load(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        ScaleSpec.load(tmp_path / "list.json")
    (tmp_path / "deep.json").write_text("[" * 100_000)
    with pytest.raises(SpecError, match="deep.json.*nested too deeply"):
        ScaleSpec.load(tmp_path / "deep.json")
    (tmp_path / "latin1.json").write_bytes('{"law": "caf\u00e9"}'.encode("latin-1"))
    with pytest.raises(SpecError, match="latin1.json.*not UTF-8"):
        ScaleSpec.load(tmp_path / "latin1.json")
    with pytest.raises(SpecError, match="is a folder"):
        ScaleSpec.load(tmp_path)
