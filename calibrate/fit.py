"""From row statistics to a scale spec: the one fitting path of ``calibrate`` and ``fit``.

``fit_spec(stats, collection, settings)`` fits the slope (``sharpdraft_theory.estimators``) and
builds the spec with its calibration record. ``sharpdraft calibrate`` calls it on the rows it
has just collected; ``sharpdraft fit`` on the rows of saved statistics files (``fit_files``),
so fitting again (another ``n_ref``, ``top_k``, granularity, estimator or cap) needs no model.

A statistics file (``calibrate --stats``) stores beside its rows the ``Collection`` they came
from and the ``FitSettings`` they were fitted with, one JSON-encoded string per key
(``record_meta``): ``drafter`` (the kind), ``drafter_path``, ``target_path``,
``aux_layer_reading``, ``drafter_info``
(the drafter's attention shape, as in the spec), ``corpus``, ``max_length``, ``dtype``,
``sequences``, ``trained_window`` (the drafter's training length, when it states one; files
written before it was stored lack it); ``n_ref``, ``top_k``, ``granularity``, ``estimator``, ``alpha_max``, ``law``,
``max_n``, ``bootstrap``; and ``tool_version``. The alpha grid and ``k_max`` are the arrays' own. So
``fit`` of one file with no options rebuilds that calibration's spec byte for byte, apart from
``calibration.tool_version``, which names the version that made the spec.

Several files are fitted as one set of rows when they were collected alike: the same drafter
(kind, paths, aux-layer reading, shape), ``max_length`` and dtype, the same alpha grid and
``k_max``; each file's sequences stay distinct units of the bootstrap. Files of one corpus hold the same leading
sequences (a corpus is always read from its start), so their rows would be counted twice: refused.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from sharpdraft_theory import __version__
from sharpdraft_theory.distance import DistanceFit, fit_distance
from sharpdraft_theory.drift import Verdict, verdict
from sharpdraft_theory.estimators import ESTIMATORS, SlopeFit, fit_slopes
from sharpdraft_theory.laws import MAX_N, alpha_law
from sharpdraft_theory.spec import GRANULARITIES, Calibration, DrafterInfo, ScaleSpec
from sharpdraft_theory.stats import RowStats
from sharpdraft_theory.tabulate import tabulate

from .errors import UserError
from .preflight import load_stats_file

__all__ = ["Collection", "FitSettings", "check_fit_options", "check_max_n", "fit_spec", "drift_verdict",
           "plausibility_notes", "record_meta", "read_record", "fit_files", "LAWS_WRITTEN", "MAX_N_PER_N_REF"]

# Plausibility (warnings in the summary, not refusals). Trained drafters fit slopes of about 0.05 to 0.5
# (Qwen's LogN scaling is slope 1 / ln n_ref, 0.13 at 2048); a slope past 1 more than quadruples the
# logits by 16 n_ref. No default --alpha-max: the spec's contract already keeps alpha finite and
# positive, and a cap would change the fitted law where it was measured; the warnings flag the rest.
PLAUSIBLE_SLOPE = 1.0
PLAUSIBLE_ALPHA_16 = 4.0
LAWS_WRITTEN = ("log-linear", "tabulated")  # the laws a calibration fits
MAX_N_PER_N_REF = 64  # a tabulated law's default reach: knots up to 64 n_ref


@dataclass(frozen=True)
class Collection:
    """How a set of rows was collected (the spec's drafter and calibration record come from it)."""

    drafter: str  # adapter kind: hf, pard, eagle3 or dflash
    drafter_path: str | None  # --drafter-path (None: built-in)
    target_path: str | None  # --target-path (None: built-in or not needed)
    aux_layer_reading: str | None  # --aux-layer-reading (None: as the head's training framework reads them)
    drafter_info: DrafterInfo  # the drafter's identity and attention shape
    corpus: str  # --corpus; several corpora joined with " + " after a merge
    max_length: int  # tokens per sequence
    dtype: str  # weight dtype of the run (float32, bfloat16, float16)
    sequences: int  # sequences the rows come from
    trained_window: int | None = None  # largest query-key distance the drafter was trained on (None: unknown)


@dataclass(frozen=True)
class FitSettings:
    """The fit's own options: they may change between collecting rows and fitting them."""

    n_ref: int  # reference length
    top_k: int  # size of the top set whose mass the slope restores
    granularity: str  # global, layer or head
    estimator: str  # whose slope the spec uses
    alpha_max: float | None  # cap written to the spec
    law: str = "log-linear"  # log-linear (one fitted slope) or tabulated (E1's alpha per bucket, then extrapolated)
    max_n: int | None = None  # tabulated: last extrapolated knot; None: MAX_N_PER_N_REF * n_ref
    bootstrap: int = 200  # bootstrap resamples of sequences for the intervals


def check_fit_options(*, top_k: int, granularity: str, estimator: str, alpha_max: float | None,
                      law: str = "log-linear", max_n: int | None = None, n_ref: int | None = None) -> None:
    """``UserError`` naming the option when a fit setting is out of range (before any work)."""
    if top_k < 1:
        raise UserError(f"--top-k {top_k}: need at least 1")
    if n_ref is not None and top_k >= n_ref:
        raise UserError(f"--top-k {top_k}: must be below --n-ref {n_ref}")
    if granularity not in GRANULARITIES:
        raise UserError(f"--granularity {granularity}: expected one of {', '.join(GRANULARITIES)}")
    if estimator not in ESTIMATORS:
        raise UserError(f"--estimator {estimator}: expected one of {', '.join(ESTIMATORS)}")
    if alpha_max is not None and not (math.isfinite(alpha_max) and alpha_max >= 1):
        raise UserError(f"--alpha-max {alpha_max}: expected a finite number >= 1")
    if law not in LAWS_WRITTEN:
        raise UserError(f"--law {law}: calibration writes one of {', '.join(LAWS_WRITTEN)}")
    if law == "tabulated" and estimator != "mass-matching":
        raise UserError(f"--estimator {estimator} with --law tabulated: the table holds mass matching's alpha "
                        "per bucket; drop --estimator, or use --law log-linear")
    if max_n is not None and law != "tabulated":
        raise UserError(f"--max-n {max_n}: only --law tabulated extrapolates to a maximum length")
    if n_ref is not None:  # else once the drafter has said its n_ref
        check_max_n(max_n, n_ref)


def check_max_n(max_n: int | None, n_ref: int) -> None:
    """``--max-n`` lies past ``n_ref`` (the table's knots do) and within the laws' range."""
    if max_n is not None and not n_ref < max_n <= MAX_N:
        raise UserError(f"--max-n {max_n}: expected more than n_ref={n_ref} (the table's knots lie past it) "
                        "and at most 2^32")


def fit_spec(stats: RowStats, collection: Collection,
             settings: FitSettings) -> tuple[ScaleSpec, SlopeFit, list[str]]:
    """Fit the law on ``stats`` and build the spec; also the notes the user should read.

    ``UserError`` when no slope (or table) can be fitted. Log-linear: the chosen estimator's
    slope, negative ones (the mass did not dilute) written as 0 since the spec's contract keeps
    alpha positive at every n. Tabulated: mass matching's alpha per bucket, extrapolated to
    ``max_n`` (``sharpdraft_theory.tabulate``) by the distance model when ``stats`` hold a
    distance profile, else by the fixed slope. The notes say what was changed, and warn about
    implausible fits (``plausibility_notes``). Rows with a distance profile also get the
    dilution/drift verdict in the calibration record (``drift_verdict``).
    """
    try:
        fit = fit_slopes(stats, n_ref=settings.n_ref, top_k=settings.top_k, granularity=settings.granularity,
                         bootstrap=settings.bootstrap, seed=0)
    except ValueError as err:
        raise UserError(f"cannot fit the slope: {err}") from None
    slope = np.asarray(fit.slopes[settings.estimator], dtype=np.float64)
    if not np.all(np.isfinite(slope)):
        result = fit.result(settings.estimator)
        others = [r.estimator for r in fit.results if r.slope is not None and r.estimator != settings.estimator]
        raise UserError(f"the {settings.estimator} estimator is undefined on this data "
                        f"({result.note or 'no finite slope'})"
                        + (f"; try --estimator {others[0]}" if others and settings.law == "log-linear" else ""))
    notes = []
    verdict, why = drift_verdict(stats, settings, collection.trained_window)
    if why:
        notes.append(why)
    calibration = Calibration(estimator=settings.estimator, corpus=collection.corpus, sequences=collection.sequences,
                              max_length=collection.max_length, rows=stats.rows, buckets=fit.buckets,
                              results=fit.results, tool_version=__version__, verdict=verdict)
    if settings.law == "tabulated":
        distance, without = _distance_models(stats, settings)
        try:
            table, filled, out_of_reach = tabulate(fit, n_ref=settings.n_ref, distance=distance,
                                                   max_n=settings.max_n or MAX_N_PER_N_REF * settings.n_ref)
        except ValueError as err:
            raise UserError(f"cannot tabulate alpha: {err}") from None
        if without and table.extrapolation:
            notes.append(f"{without}: knots past the calibrated lengths take the fixed slope")
        if filled:
            notes.append(f"{filled} {settings.granularity} values of the table were out of the alpha grid's reach "
                         "(or had no rows) and took the global bucket's alpha")
        if out_of_reach:
            notes.append(f"{out_of_reach} extrapolated {settings.granularity} values were out of the distance "
                         "model's reach (the reference mass is not crossed on its alpha grid) and took the "
                         "fixed slope's")
        law = dict(slope=None, table=table)
    else:
        if np.any(slope < 0):  # the spec's contract (alpha > 0 for every n) allows no negative log-linear slope
            notes.append(f"{int(np.sum(slope < 0))} of {slope.size} fitted slopes were negative (the mass did not "
                         f"dilute there, min {slope.min():.4f}); the spec holds 0 for them")
            slope = np.maximum(slope, 0.0)
        law = dict(slope=float(slope) if slope.ndim == 0 else slope.tolist())
    spec = ScaleSpec(law=settings.law, n_ref=settings.n_ref, top_k=settings.top_k, granularity=settings.granularity,
                     alpha_max=settings.alpha_max, drafter=collection.drafter_info, calibration=calibration, **law)
    return spec, fit, notes + plausibility_notes(spec, fit)


#: Resamples of sequences behind the verdict's intervals (at most the fit's own ``bootstrap``).
VERDICT_BOOTSTRAP = 100


def drift_verdict(stats: RowStats, settings: FitSettings,
                  trained_window: int | None) -> tuple[Verdict | None, str | None]:
    """Dilution or distance drift past the seen distances (``sharpdraft_theory.drift.verdict``), or None and why not.

    The seen window ``W`` is the drafter's training length when it states one, else ``n_ref``.
    Rows without a distance profile get None and no note (nothing was asked for).
    """
    if stats.distance is None:
        return None, None
    window = trained_window or settings.n_ref
    try:
        fit = fit_distance(stats, n_ref=settings.n_ref, top_k=settings.top_k)
        return verdict(fit, window=window, bootstrap=min(settings.bootstrap, VERDICT_BOOTSTRAP), seed=0), None
    except ValueError as err:
        return None, f"no dilution/drift verdict: {err}"


def _distance_models(stats: RowStats, settings: FitSettings) -> tuple[DistanceFit | None, str | None]:
    """The distance models a tabulated law extrapolates with, or None and why not (then the fixed slope does)."""
    if stats.distance is None:
        return None, "these rows hold no distance profile (calibrate --stats collects one)"
    try:
        return fit_distance(stats, n_ref=settings.n_ref, top_k=settings.top_k), None
    except ValueError as err:
        return None, f"the distance profile cannot be fitted ({err})"


def plausibility_notes(spec: ScaleSpec, fit: SlopeFit) -> list[str]:
    """Warnings for a fit no drafter should give (e.g. a random-weight model): a slope above
    ``PLAUSIBLE_SLOPE``, alpha at ``16 n_ref`` above the cap (or ``PLAUSIBLE_ALPHA_16`` without
    one), a 95% interval wider than the slope itself. A tabulated spec's slopes are mass matching's."""
    notes = []
    slopes = spec.slopes() if spec.table is None else np.asarray(fit.slopes["mass-matching"])
    table = None if spec.table is None else (spec.table.n, spec.values())
    alpha16 = float(np.max(alpha_law(spec.law, 16.0 * spec.n_ref, n_ref=spec.n_ref, slope=spec.slopes(),
                                     table=table)))  # uncapped, at 16 n_ref
    limit = spec.alpha_max if spec.alpha_max is not None else PLAUSIBLE_ALPHA_16
    if slopes.max() > PLAUSIBLE_SLOPE:
        notes.append(f"slope {slopes.max():.4f} is beyond the plausible range (0, {PLAUSIBLE_SLOPE:g}]: check that the "
                     "drafter is trained and the corpus is text it knows")
    if alpha16 > limit:
        notes.append(f"alpha(16 n_ref) = {alpha16:.3g} exceeds " + (f"--alpha-max {limit:g}" if spec.alpha_max
                     is not None else f"{limit:g}, more than any trained drafter needs") + "; treat this spec with care")
    result = fit.result(spec.calibration.estimator)
    if result.ci_low is not None and result.slope is not None and result.ci_high - result.ci_low > abs(result.slope):
        notes.append(f"the 95% interval [{result.ci_low:.4f}, {result.ci_high:.4f}] is wider than the slope "
                     f"{result.slope:.4f}: collect more --sequences")
    return notes


def record_meta(collection: Collection, settings: FitSettings) -> dict[str, str]:
    """The metadata a statistics file stores (module docstring), each value JSON-encoded."""
    record = {**asdict(collection), **asdict(settings), "tool_version": __version__}
    return {key: json.dumps(value) for key, value in record.items()}


#: Record keys older statistics files may lack (their defaults apply).
_OPTIONAL = ("trained_window",)


def read_record(path: str | os.PathLike) -> tuple[RowStats, Collection, FitSettings]:
    """A statistics file's rows and the record ``calibrate --stats`` stored with them."""
    path = Path(path)
    stats, raw = load_stats_file(path)
    missing = [f.name for f in fields(Collection) + fields(FitSettings)
               if f.name not in raw and f.name not in _OPTIONAL]
    if missing:
        raise UserError(f"{path}: no record of {missing[0]} (written by an older sharpdraft?); "
                        "collect it again with `sharpdraft calibrate --stats`")
    try:
        meta = {key: json.loads(raw[key]) for key in (f.name for f in fields(Collection) + fields(FitSettings))
                if key in raw}
        meta["drafter_info"] = DrafterInfo.from_dict(meta["drafter_info"])
        return (stats, Collection(**{f.name: meta[f.name] for f in fields(Collection) if f.name in meta}),
                FitSettings(**{f.name: meta[f.name] for f in fields(FitSettings)}))
    except (json.JSONDecodeError, ValueError, TypeError) as err:
        raise UserError(f"{path}: its record cannot be read ({err}); collect it again with "
                        "`sharpdraft calibrate --stats`") from None


#: Collection fields files must share to be fitted together (corpus and sequences add up instead).
_SHARED = ("drafter", "drafter_path", "target_path", "aux_layer_reading", "drafter_info", "max_length", "dtype")


def fit_files(paths: list[Path], **overrides) -> tuple[ScaleSpec, SlopeFit, RowStats, list[str]]:
    """Fit one spec on the rows of the statistics files ``paths`` (module docstring): the spec, the
    fit, the rows and the notes of ``fit_spec``.

    ``overrides`` are ``FitSettings`` fields (``n_ref``, ``top_k``, ``granularity``,
    ``estimator``, ``alpha_max``, ``law``, ``max_n``); a field that is None or not given comes from the files, which
    must then agree on it.
    """
    if not paths:
        raise UserError("no statistics file given")
    files = [(Path(p), *read_record(p)) for p in paths]
    first, first_stats, first_collection, _ = files[0]
    for path, stats, collection, _ in files[1:]:
        for name in _SHARED:
            mine, theirs = getattr(first_collection, name), getattr(collection, name)
            if mine != theirs:
                raise UserError(f"{first} and {path} were collected with different {name} ({_shown(mine)} and "
                                f"{_shown(theirs)}): their rows cannot be fitted as one set")
        if not np.array_equal(stats.alpha_grid, first_stats.alpha_grid):
            raise UserError(f"{first} and {path} were recorded on different alpha grids ({_grid(first_stats)} and "
                            f"{_grid(stats)}): their rows cannot be fitted as one set")
        if stats.k_max != first_stats.k_max:
            raise UserError(f"{first} and {path} keep different numbers of top logits (k_max {first_stats.k_max} "
                            f"and {stats.k_max}): their rows cannot be fitted as one set")
    corpora = [collection.corpus for _, _, collection, _ in files]
    for i, corpus in enumerate(corpora):
        if corpus in corpora[:i]:
            raise UserError(f"{files[corpora.index(corpus)][0]} and {files[i][0]} both hold the leading sequences "
                            f"of corpus {corpus} at max_length {first_collection.max_length}: fitting both would "
                            "count those rows twice; give one file per corpus")
    chosen = {}
    for f in fields(FitSettings):
        given = overrides.get(f.name)
        recorded = {getattr(s, f.name) for _, _, _, s in files}
        if given is None and len(recorded) > 1:
            option = "--" + f.name.replace("_", "-")
            raise UserError(f"the files were fitted with different {f.name} ({', '.join(sorted(map(str, recorded)))}): "
                            f"pass {option}")
        chosen[f.name] = given if given is not None else recorded.pop()
    settings = FitSettings(**chosen)
    check_fit_options(top_k=settings.top_k, granularity=settings.granularity, estimator=settings.estimator,
                      alpha_max=settings.alpha_max, law=settings.law, max_n=settings.max_n, n_ref=settings.n_ref)
    budgets = {(s.budget.sinks, s.budget.window) for _, s, _, _ in files if s.budget is not None}
    parts = [s if len(budgets) < 2 else replace(s, budget=None) for _, s, _, _ in files]
    stats = RowStats.concat(parts, separate_runs=True)  # each file's sequences its own
    collection = replace(first_collection, corpus=" + ".join(corpora),
                         sequences=sum(c.sequences for _, _, c, _ in files))
    spec, fit, notes = fit_spec(stats, collection, settings)
    for what, bare in (("distance statistics", [str(path) for path, s, _, _ in files if s.distance is None]),
                       ("attention budget", [str(path) for path, s, _, _ in files if s.budget is None])):
        if bare and len(bare) < len(files):
            notes.append(f"{', '.join(bare)} hold{'s' if len(bare) == 1 else ''} no {what}: the joined rows "
                         "carry none (recollect that file to keep them)")
    if len(budgets) > 1:
        shown = ", ".join(f"{sinks} sinks and {window} keys" for sinks, window in sorted(budgets))
        notes.append(f"the files' attention budgets were taken with different sinks and windows ({shown}; the window "
                     "is the n_ref of each calibration): the joined rows carry none")
    return spec, fit, stats, notes


def _shown(value) -> str:
    return json.dumps(asdict(value)) if isinstance(value, DrafterInfo) else repr(value)


def _grid(stats: RowStats) -> str:
    return f"{stats.alpha_grid.size} values {stats.alpha_grid.min():g}..{stats.alpha_grid.max():g}"
