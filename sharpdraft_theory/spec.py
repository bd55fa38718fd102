"""The JSON scale spec: the contract between calibration and the runtime.

A spec says which law scales the drafter's queries, with what reference length and slope(s), at
which granularity (one slope, one per layer, or one per layer and head), and records how the
slope was obtained. The tabulated law takes a table instead of a slope: alpha at knots of ``n``
past ``n_ref`` (shared by every layer and head), one row of values per layer or head as the
granularity says (:class:`AlphaTable`). It may also restrict the keys each query sees, as serving
engines do for long contexts: a sliding ``window`` of the last W visible keys, plus ``sinks``, the first S keys
(StreamingLLM); then ``n`` is the number of keys the query really sees. Or it may remap the RoPE
positions of the logits past the drafter's trained distances (``positions``: clamp, group or pi,
:class:`~sharpdraft_theory.positions.PositionFix`), keeping ``n``. A spec with law
``constant``, slope 0 and a window is a pure baseline (no scaling). It is versioned
(``"schema": "sharpdraft.scale-spec/v1"``), validated on load with errors (:class:`SpecError`, a
``ValueError``) that name the field, the bad value and, for a file, the file; and written atomically.

The contract on alpha: in every layer and head the law's uncapped ``alpha(n)`` is ``> 0`` for
every ``n >= 2`` and finite in float32 up to ``laws.MAX_N`` (2^32) (``laws.Law.bounds``). So log-linear and
llama4 need slopes ``>= 0``, ssmax ``> 0``, constant ``> -1``, and a table values ``> 0`` and finite in
float32; a cap (``alpha_max``) bounds alpha
from above only and makes no negative slope legal, and the spec has no floor (``alpha_min``).
``scale_spec.schema.json`` beside this file is the same contract as a JSON Schema.

The lists a spec is checked against live where they are defined: the laws and the parameters each
takes in ``laws.REGISTRY``, the estimator names in ``estimators.REGISTRY`` (whose records
``Bucket`` and ``EstimatorResult`` the calibration record holds). A drafter kind is any lowercase
identifier: which kinds exist is calibrate's business.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from .atomic import atomic_write_text
from .checks import SpecError, check_int, check_num, check_record, check_str, field_error, json_type
from .drift import Verdict
from .estimators import ESTIMATORS, Bucket, EstimatorResult
from .laws import LAWS, MAX_N, alpha_law, get_law
from .positions import PositionFix

__all__ = ["SCHEMA", "GRANULARITIES", "SELECTION_FIELDS", "SELECTION_METRIC", "CANDIDATE_FIELDS",
           "DRAFTER_KIND_PATTERN", "DrafterInfo", "Bucket", "EstimatorResult", "Calibration", "AlphaTable",
           "PositionFix", "ScaleSpec", "SpecError", "schema_path"]

SCHEMA = "sharpdraft.scale-spec/v1"
GRANULARITIES = ("global", "layer", "head")
_DEPTH = {"global": 0, "layer": 1, "head": 2}  # list levels a granularity puts before the values
_FLOAT32_MAX = float(np.finfo(np.float32).max)  # the runtime computes alpha in float32
#: A drafter kind is a lowercase identifier; which kinds exist is calibrate's business (``calibrate.drafters.KINDS``).
DRAFTER_KIND_PATTERN = r"^[a-z][a-z0-9_-]*$"


def schema_path() -> Path:
    """Path of the shipped JSON Schema file."""
    return Path(__file__).with_name("scale_spec.schema.json")


@dataclass(frozen=True)
class DrafterInfo:
    """Identity and attention shape of the drafter a spec was made for."""

    kind: str  # adapter that loads it, a lowercase identifier (e.g. eagle3); not checked against calibrate's kinds
    path: str | None  # where it was loaded from (local path or hub id); None for built-in defaults
    num_layers: int  # attention layers the runtime scales
    num_heads: int  # query heads per layer
    num_kv_heads: int  # key/value heads per layer (GQA when < num_heads)
    head_dim: int  # width of one head

    @classmethod
    def from_dict(cls, d: dict, where: str = "drafter") -> "DrafterInfo":
        check_record(where, d, cls)
        info = cls(
            kind=_kind(f"{where}.kind", d["kind"]),
            path=check_str(f"{where}.path", d["path"], nullable=True),
            num_layers=check_int(f"{where}.num_layers", d["num_layers"], 1),
            num_heads=check_int(f"{where}.num_heads", d["num_heads"], 1),
            num_kv_heads=check_int(f"{where}.num_kv_heads", d["num_kv_heads"], 1),
            head_dim=check_int(f"{where}.head_dim", d["head_dim"], 1),
        )
        if info.num_heads % info.num_kv_heads:
            raise field_error(f"{where}.num_kv_heads", f"must divide num_heads={info.num_heads}", info.num_kv_heads)
        return info


def _kind(where: str, value) -> str:
    if not isinstance(value, str) or not re.fullmatch(DRAFTER_KIND_PATTERN, value):
        raise field_error(where, "expected a lowercase identifier such as eagle3 (letters, digits, _ or -)", value)
    return value


@dataclass(frozen=True)
class Calibration:
    """How the slope was obtained."""

    estimator: str  # the estimator whose slope the spec uses (a canonical name in estimators.ESTIMATORS)
    corpus: str  # corpus name or path
    sequences: int  # sequences read
    max_length: int  # tokens per sequence
    rows: int  # attention rows measured (query, layer, head)
    buckets: tuple[Bucket, ...]  # per context-length bucket: rows, mean mass, matched alpha
    results: tuple[EstimatorResult, ...]  # every estimator's result, for comparison
    tool_version: str  # sharpdraft version that made the spec
    verdict: Verdict | None = None  # dilution or distance drift past the seen distances (drift.verdict; None: no profile)
    # calibrate --select: each candidate deployment measured on the calibration sequences, and the choice
    # (calibrate.select documents the object); None when the fitted spec was written without selection
    selection: dict | None = None

    @classmethod
    def from_dict(cls, d: dict, where: str = "calibration") -> "Calibration":
        check_record(where, d, cls)
        for name in ("buckets", "results"):
            if not isinstance(d[name], list):
                raise field_error(f"{where}.{name}", "expected a list", d[name])
        return cls(
            estimator=check_str(f"{where}.estimator", d["estimator"], ESTIMATORS),
            corpus=check_str(f"{where}.corpus", d["corpus"]),
            sequences=check_int(f"{where}.sequences", d["sequences"], 0),
            max_length=check_int(f"{where}.max_length", d["max_length"], 1),
            rows=check_int(f"{where}.rows", d["rows"], 0),
            buckets=tuple(Bucket.from_dict(b, f"{where}.buckets[{i}]") for i, b in enumerate(d["buckets"])),
            results=tuple(EstimatorResult.from_dict(r, f"{where}.results[{i}]") for i, r in enumerate(d["results"])),
            tool_version=check_str(f"{where}.tool_version", d["tool_version"]),
            verdict=None if d.get("verdict") is None else Verdict.from_dict(d["verdict"], f"{where}.verdict"),
            selection=_selection(f"{where}.selection", d.get("selection")),
        )


#: ``calibration.selection``'s fields (calibrate.select.judge writes them; all required) and a candidate's
#: (``deployment`` always, and none has nothing else; ``gain`` and ``per_bucket`` for every other candidate;
#: ``within_n_ref``, its gains at n <= n_ref, written since the rule reads them; ``versus_best`` for one that
#: qualified). Gains hold the record's ``metric`` (``SELECTION_METRIC``), and any other metric besides: a reader
#: indexes that one only. The JSON Schema's ``selection`` names the same (tests/test_spec.py keeps them in sync).
SELECTION_METRIC = "agreement"  # the metric the rule reads (``calibrate.select.RULE``); a record's only ``metric``
SELECTION_FIELDS = ("rule", "simplicity", "metric", "weights", "sequences", "buckets", "seconds", "candidates", "best",
                    "chosen", "reason")
CANDIDATE_FIELDS = ("deployment", "gain", "per_bucket", "within_n_ref", "versus_best")


def _selection(where: str, value) -> dict | None:
    """``calibration.selection``: null, or the record of ``calibrate --select`` (``SELECTION_FIELDS``): every
    candidate's gains as ``[mean, lo, hi]`` triples (finite, the bounds both null or both numbers), one per
    bucket of ``buckets``, and ``best`` and ``chosen`` among the candidates."""
    if value is None:
        return None
    _fields(where, value, SELECTION_FIELDS, SELECTION_FIELDS)
    for name in ("rule", "weights", "reason"):
        check_str(f"{where}.{name}", value[name])
    check_str(f"{where}.metric", value["metric"], (SELECTION_METRIC,))
    if not isinstance(value["simplicity"], list) or not value["simplicity"]:
        raise field_error(f"{where}.simplicity", "expected a non-empty list of kinds", value["simplicity"])
    for i, kind in enumerate(value["simplicity"]):
        check_str(f"{where}.simplicity[{i}]", kind)
    check_int(f"{where}.sequences", value["sequences"], 0)
    check_num(f"{where}.seconds", value["seconds"], 0.0)
    buckets = value["buckets"]
    if not isinstance(buckets, list) or not buckets:
        raise field_error(f"{where}.buckets", "expected a non-empty list of bucket lengths", buckets)
    for i, n in enumerate(buckets):
        check_int(f"{where}.buckets[{i}]", n, 2, maximum=MAX_N)
    cells = value["candidates"]
    if not isinstance(cells, dict) or "none" not in cells:
        raise field_error(f"{where}.candidates", "expected an object of candidates, none among them", cells)
    for name, cell in cells.items():
        _candidate(f"{where}.candidates.{name}", cell, name != "none", value["metric"], [str(n) for n in buckets])
    if value["best"] is not None and (value["best"] not in cells or value["best"] == "none"):
        raise field_error(f"{where}.best", "expected null or the name of one of its candidates but none (the best "
                                           "by mean has a gain over none)", value["best"])
    if value["chosen"] not in cells:
        raise field_error(f"{where}.chosen", "expected the name of one of its candidates", value["chosen"])
    return value


def _fields(where: str, value, known, required) -> None:
    """``value`` is an object whose fields are among ``known`` and include ``required``; else a ``SpecError``
    naming the first field that is not."""
    if not isinstance(value, dict):
        raise field_error(where, "expected an object", value)
    extra = sorted(set(value) - set(known))
    if extra:
        raise field_error(f"{where}.{extra[0]}", f"unknown field (known: {', '.join(known)})", value[extra[0]])
    missing = [f for f in required if f not in value]
    if missing:
        raise SpecError(f"spec field '{where}.{missing[0]}': required field is missing")


def _candidate(where: str, cell, measured: bool, metric: str, buckets: list[str]) -> None:
    """One candidate's cell; ``measured``: it has gains over none (every candidate but none itself)."""
    if measured:
        _fields(where, cell, CANDIDATE_FIELDS, ("deployment", "gain", "per_bucket"))
    else:
        _fields(where, cell, ("deployment",), ("deployment",))
    if cell["deployment"] is not None and not isinstance(cell["deployment"], dict):
        raise field_error(f"{where}.deployment", "expected an object or null", cell["deployment"])
    if not measured:
        return
    _gains(f"{where}.gain", cell["gain"], metric)
    per_bucket = cell["per_bucket"]
    if not isinstance(per_bucket, dict) or sorted(per_bucket) != sorted(buckets):
        raise field_error(f"{where}.per_bucket", f"expected an object with one entry per bucket ({', '.join(buckets)})",
                          per_bucket)
    for n, gains in per_bucket.items():
        _gains(f"{where}.per_bucket.{n}", gains, metric)
    if "within_n_ref" in cell:
        _gains(f"{where}.within_n_ref", cell["within_n_ref"], metric)
    if "versus_best" in cell:
        _triple(f"{where}.versus_best", cell["versus_best"])


def _gains(where: str, value, metric: str) -> None:
    """``{metric: [mean, lo, hi] or null, ...}`` holding at least the record's ``metric``."""
    if not isinstance(value, dict) or metric not in value:
        raise field_error(where, f"expected an object of gains with {metric}", value)
    for name, t in value.items():
        _triple(f"{where}.{name}", t)


def _triple(where: str, value) -> None:
    """null, or ``[mean, lo, hi]``: finite numbers, the bounds both null (no interval) or both numbers."""
    if value is None:
        return
    if not isinstance(value, list) or len(value) != 3:
        raise field_error(where, "expected [mean, lo, hi] or null", value)
    check_num(f"{where}[0]", value[0])
    if (value[1] is None) != (value[2] is None):
        raise field_error(where, "expected both bounds or neither", value)
    for i in (1, 2):
        check_num(f"{where}[{i}]", value[i], nullable=True)


@dataclass(frozen=True)
class AlphaTable:
    """The tabulated law's table (``laws.KnotTable`` evaluates it).

    Alpha is 1 up to ``n_ref`` (the implicit first knot), linear in ``ln n`` between knots, and
    held at its last value past the last knot; the spec's ``alpha_max`` caps it.
    """

    n: tuple[int, ...]  # knots: visible-key counts past n_ref, strictly increasing; shared by every layer and head
    alpha: tuple  # alpha (> 0) at each knot: [knot] (global), [layer][knot] or [layer][head][knot]
    measured: int | None = None  # leading knots calibrated (the rest model-extrapolated); None: hand-written
    extrapolation: str | None = None  # the model behind the knots past the measured ones (None: there are none)

    @classmethod
    def from_dict(cls, d: dict, where: str, n_ref: int, granularity: str) -> "AlphaTable":
        check_record(where, d, cls)
        knots = d["n"]
        if not isinstance(knots, list) or not knots:
            raise field_error(f"{where}.n", "expected a non-empty list of knots", knots)
        for j, knot in enumerate(knots):
            if check_int(f"{where}.n[{j}]", knot, maximum=MAX_N) <= n_ref:
                raise field_error(f"{where}.n[{j}]", f"knots lie past n_ref={n_ref} (alpha is 1 up to it)", knot)
            if j and knot <= knots[j - 1]:
                raise field_error(f"{where}.n[{j}]", f"knots must increase strictly (previous {knots[j - 1]})", knot)
        measured = check_int(f"{where}.measured", d.get("measured"), 0, nullable=True)
        if measured is not None and measured > len(knots):
            raise field_error(f"{where}.measured", f"expected at most the {len(knots)} knots", measured)
        return cls(n=tuple(knots), alpha=_table_values(f"{where}.alpha", d["alpha"], _DEPTH[granularity], len(knots)),
                   measured=measured, extrapolation=check_str(f"{where}.extrapolation", d.get("extrapolation"),
                                                              nullable=True))


def _table_values(where: str, value, depth: int, knots: int):
    """Validate a table's values: ``depth`` list levels (layers, heads) of equal length, then one value per knot."""
    if not isinstance(value, list) or not value:
        raise field_error(where, "expected a non-empty list", value)
    if depth == 0:
        if len(value) != knots:
            raise field_error(where, f"needs one value per knot ({knots})", f"{len(value)} values")
        for j, v in enumerate(value):
            a = check_num(f"{where}[{j}]", v, 0.0, exclusive=True)
            if a > _FLOAT32_MAX:
                raise field_error(f"{where}[{j}]", "alpha must be finite in float32", v)
        return tuple(float(v) for v in value)
    rows = tuple(_table_values(f"{where}[{i}]", row, depth - 1, knots) for i, row in enumerate(value))
    if len({np.shape(r) for r in rows}) != 1:
        raise field_error(where, "every layer needs the same number of heads", _as_lists(rows))
    return rows


def _slope(where: str, value, granularity: str):
    """Validate a slope's nesting against the granularity; return it as nested tuples."""
    if granularity == "global":
        return check_num(where, value)
    if not isinstance(value, list) or not value:
        raise field_error(where, f"granularity '{granularity}' needs a non-empty list", value)
    if granularity == "layer":
        return tuple(check_num(f"{where}[{i}]", v) for i, v in enumerate(value))
    rows = []
    for i, row in enumerate(value):
        if not isinstance(row, list) or not row:
            raise field_error(f"{where}[{i}]", "granularity 'head' needs a list per layer", row)
        rows.append(tuple(check_num(f"{where}[{i}][{j}]", v) for j, v in enumerate(row)))
    if len({len(r) for r in rows}) != 1:
        raise field_error(where, "every layer needs the same number of head slopes", value)
    return tuple(rows)


@dataclass(frozen=True)
class ScaleSpec:
    """A cardinality-aware query-scaling spec (see ``sharpdraft_theory.laws`` for the laws).

    Examples
    --------
    >>> spec = ScaleSpec(law="log-linear", n_ref=512, slope=0.2, top_k=4)
    >>> spec.alpha([512, 1024]).round(4).tolist()
    [1.0, 1.1386]
    >>> ScaleSpec.from_json(spec.to_json()) == spec
    True
    """

    law: str  # a name in laws.LAWS (log-linear is SharpDraft's law)
    n_ref: int | None  # reference length (the drafter's training context); None only for a law that takes none
    slope: float | tuple | None  # the law's coefficient: a float, one per layer, or [layer][head]; None if it has none
    top_k: int  # size of the top set whose mass the slope restores
    granularity: str = "global"  # global, layer or head: how `slope` is nested
    alpha_max: float | None = None  # cap on alpha (None: no cap)
    table: AlphaTable | None = None  # the tabulated law's knots and values; None for every other law
    window: int | None = None  # W: each query sees only its last W visible keys (drafter sliding window); None: all
    sinks: int | None = None  # S: the first S keys of the sequence stay visible besides the window (needs window)
    # Distance fix (positions.PositionFix): clamp, group or pi remap the RoPE positions of the logits past the
    # trained distances, the neighbour window's exact; alpha(n) still counts the n visible keys. None: true positions
    positions: PositionFix | None = None
    drafter: DrafterInfo | None = None  # what the spec was made for
    calibration: Calibration | None = None  # how the slope was obtained (None for hand-written specs)
    schema: str = SCHEMA  # format version

    def __post_init__(self):
        # Round-trip through the validator so a spec built in code obeys the same contract.
        checked = ScaleSpec._validated(self.to_dict())
        object.__setattr__(self, "slope", checked["slope"])
        object.__setattr__(self, "table", checked["table"])
        object.__setattr__(self, "positions", checked["positions"])

    # -- validation --------------------------------------------------------------------------
    @staticmethod
    def _validated(d: dict) -> dict:
        if not isinstance(d, dict):
            raise SpecError(f"spec: expected a JSON object with law, n_ref, slope and top_k, got {json_type(d)}")
        known = {f.name for f in fields(ScaleSpec)}
        extra = sorted(set(d) - known)
        if extra:
            raise field_error(extra[0], f"unknown field (known: {', '.join(sorted(known))})", d[extra[0]])
        for name in ("law", "n_ref", "slope", "top_k"):
            if name not in d:
                raise SpecError(f"spec field '{name}': required field is missing")
        schema = d.get("schema", SCHEMA)
        if schema != SCHEMA:
            raise field_error("schema", f"expected {SCHEMA!r} (this sharpdraft reads v1 specs only)", schema)
        law = get_law(check_str("law", d["law"], LAWS))
        top_k = check_int("top_k", d["top_k"], 1, maximum=MAX_N)
        n_ref = check_int("n_ref", d["n_ref"], 2, nullable=not law.needs_n_ref, maximum=MAX_N)
        if n_ref is not None and n_ref <= top_k:
            raise field_error("n_ref", f"must exceed top_k={top_k}", n_ref)
        granularity = check_str("granularity", d.get("granularity", "global"), GRANULARITIES)
        if not law.has_slope:
            if d["slope"] is not None:
                raise field_error("slope", f"{law.name} has no slope; use null", d["slope"])
            slope = None
        else:
            slope = _slope("slope", _as_lists(d["slope"]), granularity)
        table = d.get("table")
        if not law.has_table:
            if table is not None:
                raise field_error("table", f"{law.name} takes no table; use null (or law tabulated)", _as_lists(table))
        elif isinstance(table, dict):
            table = AlphaTable.from_dict(table, "table", n_ref, granularity)
        elif isinstance(table, AlphaTable):
            table = AlphaTable.from_dict(_as_lists(asdict(table)), "table", n_ref, granularity)
        else:
            raise field_error("table", "tabulated needs a table: an object with knots n and values alpha", table)
        alpha_max = check_num("alpha_max", d.get("alpha_max"), 0.0, exclusive=True, nullable=True)
        if alpha_max is not None and alpha_max < law.min_alpha_max:
            raise field_error("alpha_max", f"{law.name} needs alpha_max >= {law.min_alpha_max:g}", alpha_max)
        window = check_int("window", d.get("window"), 1, nullable=True)
        sinks = check_int("sinks", d.get("sinks"), 1, nullable=True)
        if sinks is not None and window is None:
            raise field_error("sinks", "sinks keep the first keys besides a window: set window too", sinks)
        positions = d.get("positions")
        if isinstance(positions, PositionFix):
            positions = positions.to_dict()
        if positions is not None:
            positions = PositionFix.from_dict(positions)
            if window is not None:
                raise field_error("positions", "a window drops the far keys whose positions a distance fix remaps; "
                                               "use one or the other", positions.to_dict())
            if positions.window is not None and n_ref is not None and positions.window >= n_ref:
                raise field_error("positions.window", f"must be below n_ref={n_ref} (the neighbour window keeps "
                                                      "trained distances exact; past n_ref a distance is itself "
                                                      "untrained)", positions.window)
            if positions.n_ref is not None and n_ref is not None and positions.n_ref > n_ref:
                raise field_error("positions.n_ref", f"must be at most n_ref={n_ref} (pi leaves a row up to its own "
                                                     "n_ref as it is, and past the spec's n_ref a distance is "
                                                     f"untrained); write {n_ref}", positions.n_ref)
        # A table's values were checked one by one (> 0, finite in float32): they are its extremes, with 1.
        low, high = (1.0, 1.0) if law.has_table else law.bounds(
            n_ref=n_ref, values=None if slope is None else np.asarray(slope, dtype=np.float64))
        if not np.isfinite(high):
            raise field_error("slope", f"{law.name} takes alpha(n) past float32's range for some 2 <= n <= 2^32; "
                                       "alpha must stay finite", d["slope"])
        if not low > 0:
            raise field_error("slope", f"{law.name} takes alpha(n) down to {low:.4g} as n grows; alpha must stay > 0 "
                                       "(a cap does not help)", d["slope"])
        drafter = d.get("drafter")
        if isinstance(drafter, dict):
            drafter = DrafterInfo.from_dict(drafter)
        elif drafter is not None and not isinstance(drafter, DrafterInfo):
            raise field_error("drafter", "expected an object", drafter)
        calibration = d.get("calibration")
        if isinstance(calibration, dict):
            calibration = Calibration.from_dict(calibration)
        elif calibration is not None and not isinstance(calibration, Calibration):
            raise field_error("calibration", "expected an object", calibration)
        if drafter is not None and granularity != "global":
            name, per_layer = ("table.alpha", table.alpha) if table is not None else ("slope", slope)
            layers = len(per_layer)
            if layers != drafter.num_layers:
                raise field_error(name, f"needs one entry per layer ({drafter.num_layers})", f"{layers} entries")
            if granularity == "head" and len(per_layer[0]) != drafter.num_heads:
                raise field_error(f"{name}[0]", f"needs one entry per head ({drafter.num_heads})",
                                  f"{len(per_layer[0])} entries")
        return dict(law=law.name, n_ref=n_ref, slope=slope, top_k=top_k, granularity=granularity, alpha_max=alpha_max,
                    table=table, window=window, sinks=sinks, positions=positions, drafter=drafter,
                    calibration=calibration, schema=schema)

    # -- I/O ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["slope"] = _as_lists(self.slope)
        for name in ("table", "positions", "drafter", "calibration"):
            if d[name] is not None and not isinstance(d[name], dict):
                d[name] = _as_lists(asdict(d[name]))
        return {"schema": d.pop("schema"), **d}

    @classmethod
    def from_dict(cls, d: dict) -> "ScaleSpec":
        return cls(**ScaleSpec._validated(d))

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "ScaleSpec":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise SpecError(f"spec: not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from None
        except RecursionError:
            raise SpecError("spec: not valid JSON (nested too deeply to read)") from None
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike) -> None:
        """Write the spec atomically (temp file, then rename)."""
        atomic_write_text(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ScaleSpec":
        """Read and validate a spec file; every problem is a one-line :class:`SpecError` naming the file."""
        where = f"spec file {str(path)!r}"
        if Path(path).is_dir():
            raise SpecError(f"{where}: is a folder; give the spec's .json file")
        try:
            raw = Path(path).read_bytes()
        except OSError as err:
            raise SpecError(f"{where}: cannot read it ({err.strerror})") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise SpecError(f"{where}: not UTF-8 text (byte {err.start}); a spec is a JSON file such as "
                            "`sharpdraft calibrate` writes") from None
        try:
            return cls.from_json(text)
        except SpecError as err:
            fix = ("; fix the file, or write a new one with `sharpdraft calibrate`"
                   if "not valid JSON" in str(err) else "")
            raise SpecError(f"{where}: {str(err).removeprefix('spec: ')}{fix}") from None

    def check_fits(self, num_layers: int, num_heads: int, what: str = "the model") -> None:
        """SpecError naming both shapes unless this spec can scale ``what`` (``num_layers`` x ``num_heads``).

        The drafter the spec was made for (when recorded) must have that shape, and per-layer or
        per-head slopes (or table values) must have one entry per layer (and head).
        """
        theirs = f"{what} has {_count(num_layers, 'layer')} x {_count(num_heads, 'head')}"
        d = self.drafter
        if d is not None and (d.num_layers, d.num_heads) != (num_layers, num_heads):
            raise SpecError(f"the spec was made for a drafter of kind {d.kind} with {_count(d.num_layers, 'layer')} x "
                            f"{_count(d.num_heads, 'head')}, {theirs}; calibrate a spec for it")
        shape, what = self.shape(), "slopes" if self.table is None else "table values"
        if self.granularity != "global" and shape[0] != num_layers:
            raise SpecError(f"the spec has {self.granularity} {what} for {_count(shape[0], 'layer')}, {theirs}")
        if self.granularity == "head" and shape[1] != num_heads:
            raise SpecError(f"the spec has {what} for {_count(shape[1], 'head')}, {theirs}")

    # -- evaluation --------------------------------------------------------------------------
    def restricts(self) -> bool:
        """Whether the spec restricts which keys a query sees (a window, with or without sinks)."""
        return self.window is not None

    def slopes(self) -> np.ndarray | None:
        """Slopes as an array: shape (), (layers,) or (layers, heads); None when the law has none."""
        return None if self.slope is None else np.asarray(self.slope, dtype=np.float64)

    def values(self) -> np.ndarray | None:
        """The law's parameters as an array: the slopes, or the table's alpha with a trailing knots
        axis ((knots,), (layers, knots) or (layers, heads, knots)); None for a law with neither."""
        return self.slopes() if self.table is None else np.asarray(self.table.alpha, dtype=np.float64)

    def shape(self) -> tuple[int, ...]:
        """Layers and heads the spec's parameters are given for: (), (layers,) or (layers, heads).

        Examples
        --------
        >>> ScaleSpec(law="log-linear", n_ref=64, slope=[0.1, 0.2], top_k=4, granularity="layer").shape()
        (2,)
        """
        values = self.values()
        return () if values is None else values.shape[:_DEPTH[self.granularity]]

    def identity_limit(self) -> float:
        """Largest ``n`` up to which ``alpha(n) == 1`` exactly in every layer and head (see ``Law.identity_limit``).

        Examples
        --------
        >>> ScaleSpec(law="llama4", n_ref=8192, slope=0.1, top_k=4).identity_limit()
        8191
        """
        return get_law(self.law).identity_limit(n_ref=self.n_ref, values=self.values(), alpha_max=self.alpha_max)

    def alpha(self, n, layer: int | None = None) -> np.ndarray:
        """``alpha(n)`` in float64; with a per-layer/per-head spec give ``layer`` (per head: a heads axis last).

        Examples
        --------
        >>> table = AlphaTable(n=(512, 1024), alpha=(1.5, 2.0))
        >>> spec = ScaleSpec(law="tabulated", n_ref=256, slope=None, top_k=4, table=table)
        >>> spec.alpha([256, 512, 768, 8192]).round(4).tolist()
        [1.0, 1.5, 1.7925, 2.0]
        """
        values = self.values()
        if self.granularity != "global":
            if layer is None:
                raise ValueError(f"this spec has {self.granularity} {'table values' if self.table else 'slopes'}: "
                                 "pass layer=")
            values = values[layer]
        n = np.asarray(n, dtype=np.float64)
        if self.granularity == "head":
            n = n[..., None]
        table = None if self.table is None else (self.table.n, values)
        return alpha_law(self.law, n, n_ref=self.n_ref, slope=None if self.table else values, table=table,
                         alpha_max=self.alpha_max)


def _as_lists(value):
    """Nested tuples (and numpy arrays) to nested lists, for JSON."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return [_as_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_lists(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    return value


def _count(n: int, noun: str) -> str:
    """``1 layer``, ``2 layers``."""
    return f"{n} {noun}" + ("" if n == 1 else "s")
