"""Dilution or distance drift: what happens past the seen distances, from calibration statistics.

RoPE logits depend on positions only through the query-key distance ``d``, so a head trained on
queries that saw at most ``W`` keys has never scored a key at ``d > W`` (docs/theory.md, section 8).
Past ``W`` the background of the distance model (``sharpdraft_theory.distance``) splits in two::

    S_B,r(a; n) = S_B,r(a) + sum_{d = n_r}^{W} P(a, d)  +  sum_{d = W + 1}^{n - 1} P(a, d)
                  anchor row (n_r <= W)   seen distances      unseen distances

with anchor rows ``r`` of ``n_r`` keys in ``(m / sqrt 2, m]``, ``m = min(W, longest measured n)``.
The unseen sum is taken two ways:

* **continued** ``P_c``: the profile measured at ``d <= W`` only, its power tail
  ``ln P_c(a, d) = c(a) + e(a) ln d`` fitted over the last two octaves of seen distances and
  carried past ``W`` (what the far keys would weigh if they were scored as the seen ones);
* **measured** ``P_m``: the profile the statistics hold at ``d > W``.

Masses at a length ``n`` (``M_ref``: mass matching's reference mass at ``n_ref``, ``a = 1``)::

    M_c(a; n)    anchor rows extended with P_c           dilution alone
    M_m(a; n)    anchor rows extended with P_m           dilution and drift
    dilution   = M_ref - M_c(1; n)                       mass that more keys, scored as in training, remove
    drift      = M_c(1; n) - M_m(1; n)                   mass the unseen distances remove on top of it

and the far profile's gap to its continuation, at every ``a`` of the profile::

    lambda(a)  = ln sum_{W < d < n} P_m(a, d) - ln sum_{W < d < n} P_c(a, d)      level (nats)
    tilt       = d lambda / d a at a = 1 = zbar_m(1) - zbar_c(1)                  spread (logit units)

``d ln sum P(a, d) / d a`` is the tilted mean logit of those keys, so the tilt is how far the far
keys' weighted logits sit above the continuation's: it is how much faster than predicted a query
scale raises their weight. Sums over several heads (a layer, the model) add the heads' sums.

**Verdict** (:func:`verdict`), on the global decomposition at the longest measured ``n``, with
95% percentile intervals over resampled sequences (point values when there is one sequence):

* drift is flagged when the lower end of ``lambda(1)``, or of ``lambda(a_c)`` at the scale
  ``a_c`` that dilution alone calls for (``M_c(a_c; n) = M_ref``), exceeds ``LEVEL_THRESHOLD``
  (``ln 2``: the unseen keys weigh at least twice what the seen profile predicts);
* dilution is flagged when the lower end of ``dilution`` exceeds ``DILUTION_THRESHOLD`` (0.02
  of mass);
* ``both`` / ``distance`` / ``dilution`` / ``neither`` as the two flags say. Drift needs measured
  distances past ``W``; without them only dilution is judged, and the record says so.

What each part predicts (docs/theory.md, section 8): dilution alone is what a query scale undoes
(``a_c`` restores ``M_ref`` with the far keys scored as in training); drift is what a window of
``W`` keys (it drops the unseen distances) or a position fix (it maps them back into the seen
range) undoes, and a query scale concentrates mass on the drifted keys when the tilt is positive.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields

import numpy as np

from .checks import check_int, check_num, check_record, check_str, field_error
from .distance import DistanceFit, DistanceProfile, crossing

__all__ = ["LEVEL_THRESHOLD", "DILUTION_THRESHOLD", "VERDICTS", "DriftParts", "Verdict", "continued_profiles",
           "decompose", "verdict"]

#: Drift: the unseen keys weigh at least twice what the seen profile, continued, predicts (nats).
LEVEL_THRESHOLD = float(np.log(2.0))
#: Dilution: dilution alone removes at least this much top-k mass.
DILUTION_THRESHOLD = 0.02
#: The verdicts, in the order of the flags (dilution, drift): neither, dilution, distance, both.
VERDICTS = ("dilution", "distance", "both", "neither")


def continued_profiles(fit: DistanceFit, window: int, seq_weights=None) -> tuple[DistanceProfile, ...]:
    """Each head's profile from the bins of seen distances (``d <= window``) only, tail continued past them.

    The bins kept are those wholly at ``d <= window`` (upper edge ``<= window + 1``); the power tail
    is fitted over their last ``fit.octaves`` octaves (``DistanceProfile.from_sums``).
    """
    c = np.ones(fit.sequences) if seq_weights is None else np.asarray(seq_weights, dtype=np.float64)
    cut = int(np.searchsorted(fit.edges, window + 1, side="right")) - 1  # bins [0, cut) lie at d <= window
    if cut < 2:
        raise ValueError(f"the distance profile has fewer than two bins of seen distances (d <= {window})")
    weight = np.einsum("s,shba->hba", c, fit.seq_weight[:, :, :cut])
    keys = np.einsum("s,shb->hb", c, fit.seq_keys[:, :, :cut])
    return tuple(DistanceProfile.from_sums(fit.alpha, fit.edges[:cut + 1], weight[h], keys[h], tail="power",
                                           octaves=fit.octaves) for h in range(weight.shape[0]))


@dataclass(frozen=True)
class DriftParts:
    """The decomposition at one length, per group (module docstring); ``low``/``high``: 95% over sequences."""

    n: int  # length it is read at
    window: int  # W: the largest seen distance
    anchor: int  # m: anchor rows have n_r in (m / sqrt 2, m]
    alpha: np.ndarray  # (A,) query scales of the profile
    tested: bool  # distances past W were measured (else level, tilt and drift are NaN)
    mass_ref: np.ndarray  # (*groups) M_ref
    mass_continued: np.ndarray  # (*groups, A) M_c(a; n)
    mass_measured: np.ndarray  # (*groups, A) M_m(a; n)
    level: np.ndarray  # (*groups, A) lambda(a), nats
    alpha_continued: np.ndarray  # (*groups) a_c: M_c(a_c; n) = M_ref (NaN: not reached on the grid)
    # name -> (point, low, high), each (*groups): dilution, drift, level (a = 1), level_fix (a = a_c), tilt
    summary: dict

    def value(self, name: str) -> np.ndarray:
        return self.summary[name][0]

    def low(self, name: str) -> np.ndarray:
        return self.summary[name][1]

    def high(self, name: str) -> np.ndarray:
        return self.summary[name][2]


def _one(fit: DistanceFit, window: int, n: int, anchor: int, granularities, c, tested: bool) -> dict:
    """Every quantity of the decomposition per granularity, for sequence weights ``c`` (None: each sequence once).

    The models are evaluated per head once; a group's mass is the row-weighted mean of its heads'
    (the mean over all its anchor rows, as ``DistanceFit.mass``), its far sums the sums of its heads'.
    """
    c = np.ones(fit.sequences) if c is None else c
    measured = fit.profiles(c)
    continued = continued_profiles(fit, window, c)
    heads = len(measured)
    m_c = fit.mass([n], "head", seq_weights=c, profiles=continued, anchor=anchor)[0].reshape(heads, -1)
    m_m = fit.mass([n], "head", seq_weights=c, profiles=measured, anchor=anchor)[0].reshape(heads, -1)
    rows = (fit.row_n <= anchor) & (fit.row_n > anchor / np.sqrt(2.0))
    w = np.bincount(fit.row_head[rows], weights=c[fit.row_seq[rows]], minlength=heads)  # anchor row weight per head
    if tested:
        with np.errstate(divide="ignore"):
            far_m = np.stack([p.log_sum([window + 1], [n])[0] for p in measured])  # (H, A)
            far_c = np.stack([p.log_sum([window + 1], [n])[0] for p in continued])
    one = int(np.argmin(np.abs(fit.alpha - 1.0)))
    out = {}
    for granularity in granularities:
        of_head, shape = fit._groups(granularity)
        groups = int(np.prod(shape)) if shape else 1
        member = of_head[None, :] == np.arange(groups)[:, None]  # (G, H)
        weight = member * w[None, :]
        with np.errstate(invalid="ignore", divide="ignore"):
            total = weight.sum(axis=1)[:, None]
            mc = np.einsum("gh,ha->ga", weight, np.nan_to_num(m_c)) / total
            mm = np.einsum("gh,ha->ga", weight, np.nan_to_num(m_m)) / total
        ref = np.asarray(fit.mass_ref(granularity, seq_weights=c), dtype=np.float64).reshape(groups)
        a_c = crossing(fit.alpha, mc, ref)  # (G,)
        if tested:
            with np.errstate(invalid="ignore"):
                level = np.stack([np.logaddexp.reduce(far_m[m], axis=0) - np.logaddexp.reduce(far_c[m], axis=0)
                                  for m in member])  # (G, A)
            tilt = np.gradient(level, fit.alpha, axis=1)[:, one]
            at_fix = np.array([np.interp(a, fit.alpha, lv) if np.isfinite(a) else np.nan for a, lv in zip(a_c, level)])
            drift = mc[:, one] - mm[:, one]
        else:
            level = np.full(mc.shape, np.nan)
            tilt = at_fix = drift = np.full(groups, np.nan)
        out[granularity] = dict(mass_ref=ref, mass_continued=mc, mass_measured=mm, level=level, alpha_continued=a_c,
                                dilution=ref - mc[:, one], drift=drift, level_one=level[:, one], level_fix=at_fix,
                                tilt=tilt)
    return out


_SUMMARY = {"dilution": "dilution", "drift": "drift", "level": "level_one", "level_fix": "level_fix", "tilt": "tilt"}


def decompose(fit: DistanceFit, *, window: int, n: int | None = None, granularity="global",
              bootstrap: int = 200, seed: int = 0):
    """The split of the background past the seen distances ``d <= window`` at length ``n`` (module docstring).

    Parameters
    ----------
    fit : DistanceFit
        Models of a calibration's rows and distance profile (``fit_distance``).
    window : int
        ``W``: the largest query-key distance the drafter saw in training (its training length, or
        ``n_ref`` when that is what it was trained at).
    n : int, optional
        Length to read the decomposition at; default the longest measured row. Past ``n_ref`` and
        at most the longest measured row (the measured profile is not extrapolated here).
    granularity : {"global", "layer", "head"} or a tuple of them
        A tuple gives a tuple of ``DriftParts`` from the same resamples.
    bootstrap : int
        Resamples of sequences for the intervals (0, or one sequence: no intervals, low = high = NaN).

    Returns
    -------
    DriftParts (or a tuple of them). The anchor rows are those near ``m = min(W, n)``; when
    ``n <= W + 1`` no distance past ``W`` is involved (``tested`` False): dilution only.

    Raises
    ------
    ValueError
        With one line saying what the decomposition needs: ``n`` within ``(n_ref, longest]``, rows
        near ``m``, two bins of seen distances.
    """
    many = not isinstance(granularity, str)
    granularities = tuple(granularity) if many else (granularity,)
    longest = int(fit.row_n.max())
    n = longest if n is None else int(n)
    if window < 2:
        raise ValueError(f"the seen window must be at least 2 keys, got {window}")
    if not fit.n_ref < n <= longest:
        raise ValueError(f"the decomposition needs a length past n_ref = {fit.n_ref} within the measured rows "
                         f"(longest {longest}), got n = {n}")
    anchor = min(window, n)
    if not np.any((fit.row_n <= anchor) & (fit.row_n > anchor / np.sqrt(2.0))):
        raise ValueError(f"no measured rows with n in ({anchor / np.sqrt(2.0):.0f}, {anchor}] to anchor the "
                         "continuation on")
    far_bins = fit.edges[1:] > window + 1  # bins holding distances past W
    tested = n > window + 1 and bool(fit.seq_keys[:, :, far_bins].sum() > 0)
    point = _one(fit, window, n, anchor, granularities, None, tested)
    draws = []
    if bootstrap > 0 and fit.sequences > 1:
        rng = np.random.default_rng(seed)
        weights = rng.multinomial(fit.sequences, np.full(fit.sequences, 1.0 / fit.sequences), size=bootstrap)
        with warnings.catch_warnings():  # a resample without rows in some head: NaN there, left out below
            warnings.simplefilter("ignore", RuntimeWarning)
            draws = [_one(fit, window, n, anchor, granularities, c.astype(np.float64), tested) for c in weights]
    out = []
    for gran in granularities:
        _, shape = fit._groups(gran)
        p = point[gran]
        summary = {}
        for name, key in _SUMMARY.items():
            value = p[key].reshape(shape)
            low = high = np.full(value.shape, np.nan)
            if draws:
                samples = np.stack([d[gran][key] for d in draws]).reshape((len(draws), *shape))
                enough = np.isfinite(samples).sum(axis=0) >= max(10, len(draws) // 2)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    lo, hi = np.nanpercentile(samples, [2.5, 97.5], axis=0)
                low, high = np.where(enough, lo, np.nan), np.where(enough, hi, np.nan)
            summary[name] = (value, low, high)
        out.append(DriftParts(n=n, window=int(window), anchor=anchor, alpha=fit.alpha, tested=tested,
                              mass_ref=p["mass_ref"].reshape(shape),
                              mass_continued=p["mass_continued"].reshape((*shape, -1)),
                              mass_measured=p["mass_measured"].reshape((*shape, -1)),
                              level=p["level"].reshape((*shape, -1)),
                              alpha_continued=p["alpha_continued"].reshape(shape), summary=summary))
    return tuple(out) if many else out[0]


@dataclass(frozen=True)
class Verdict:
    """Which fix the statistics point to, and the numbers behind it (the spec's ``calibration.verdict``)."""

    verdict: str  # one of VERDICTS
    n: int  # length the decomposition is read at
    window: int  # W: largest seen distance
    n_ref: int  # reference length of M_ref
    mass_ref: float  # M_ref
    mass_continued: float  # M_c(1; n): dilution alone
    mass_measured: float  # M_m(1; n): with the measured far profile
    dilution: float  # M_ref - M_c(1; n), and its 95% interval over sequences (None: no interval)
    dilution_low: float | None
    dilution_high: float | None
    drift: float | None  # M_c(1; n) - M_m(1; n) (None: no distance past W measured)
    level: float | None  # lambda(1), nats, and its interval
    level_low: float | None
    level_high: float | None
    level_fix: float | None  # lambda(a_c): the level at the scale dilution alone calls for
    level_fix_low: float | None
    tilt: float | None  # d lambda / d a at 1, logit units, and its interval
    tilt_low: float | None
    tilt_high: float | None
    alpha_continued: float | None  # a_c: the scale that restores M_ref under dilution alone (None: off the grid)
    heads: int  # heads judged
    heads_drift: int  # heads whose drift flag is set (same rule, per head)
    heads_dilution: int  # heads whose dilution flag is set
    note: str | None = None  # what the verdict could not judge, or what else to know
    level_threshold: float = LEVEL_THRESHOLD  # the drift flag's threshold on the level, nats
    dilution_threshold: float = DILUTION_THRESHOLD  # the dilution flag's threshold, mass

    @classmethod
    def from_dict(cls, d: dict, where: str = "calibration.verdict") -> "Verdict":
        """Check a JSON-decoded record (the spec loader's contract: one-line ``SpecError`` naming the field)."""
        check_record(where, d, cls)
        values = {}
        for f in fields(cls):
            if f.name not in d:
                continue
            value, at = d[f.name], f"{where}.{f.name}"
            if f.name == "verdict":
                values[f.name] = check_str(at, value, VERDICTS)
            elif f.name == "note":
                values[f.name] = check_str(at, value, nullable=True)
            elif f.name in ("n", "window", "n_ref"):
                values[f.name] = check_int(at, value, 2)
            elif f.name.startswith("heads"):
                values[f.name] = check_int(at, value, 0)
            elif f.name.startswith("mass_"):
                mass = check_num(at, value, 0.0)
                if mass > 1:
                    raise field_error(at, "expected a mass in [0, 1]", value)
                values[f.name] = mass
            else:
                values[f.name] = check_num(at, value, nullable=f.name not in ("dilution", "level_threshold",
                                                                                "dilution_threshold"))
        return cls(**values)

    def line(self) -> str:
        """One line: the verdict and the numbers behind it."""
        return f"verdict {self.verdict}: {self.numbers()}"

    def numbers(self) -> str:
        """The numbers behind the verdict, with their 95% intervals over sequences."""
        def iv(lo, hi):
            return "" if lo is None else f" [{lo:.3f}, {hi:.3f}]"

        parts = [f"dilution {self.dilution:.3f}{iv(self.dilution_low, self.dilution_high)} of top-k mass "
                 f"(M_ref {self.mass_ref:.3f} -> {self.mass_continued:.3f} at n = {self.n:,} with far keys as seen)"]
        if self.level is not None:
            parts.append(f"drift {self.drift:+.3f} of mass, far-key level {self.level:+.2f}"
                         f"{iv(self.level_low, self.level_high)} nats against the continuation from d <= {self.window}"
                         + (f" ({self.level_fix:+.2f} at alpha {self.alpha_continued:.2f})"
                            if self.level_fix is not None else "")
                         + f", tilt {self.tilt:+.2f}{iv(self.tilt_low, self.tilt_high)}")
        parts.append(f"heads flagged: drift {self.heads_drift}/{self.heads}, dilution {self.heads_dilution}/{self.heads}")
        return "; ".join(parts)

    @property
    def advice(self) -> str:
        return {"dilution": "a query scale should help (far keys are scored as the seen ones)",
                "distance": "a window of the seen keys or a position fix should help, a query scale should not",
                "both": "a window of the seen keys (it drops both parts), or a position fix and then a query scale; "
                        "a query scale alone should not help",
                "neither": "little to fix past n_ref"}[self.verdict]


def _flags(parts: DriftParts, index=()) -> tuple[bool, bool]:
    """(dilution, drift) flags at ``index`` of the groups: lower ends of the intervals, or points without one."""
    def lower(name):
        lo = parts.low(name)[index]
        return float(lo) if np.isfinite(lo) else float(parts.value(name)[index])

    dilution = lower("dilution") > DILUTION_THRESHOLD
    if not parts.tested:
        return dilution, False
    levels = [lower("level")] + ([lower("level_fix")] if np.isfinite(parts.value("level_fix")[index]) else [])
    return dilution, max(levels) > LEVEL_THRESHOLD


def _label(dilution: bool, drift: bool) -> str:
    return ("both" if dilution else "distance") if drift else ("dilution" if dilution else "neither")


def verdict(fit: DistanceFit, *, window: int, n: int | None = None, bootstrap: int = 200, seed: int = 0,
            parts: tuple[DriftParts, DriftParts] | None = None) -> Verdict:
    """The verdict (module docstring) on the global decomposition, with per-head flag counts.

    ``parts``: the global and per-head :func:`decompose` already made (else made here, from the
    same resamples). ``ValueError`` as :func:`decompose`.
    """
    g, h = parts if parts is not None else decompose(fit, window=window, n=n, granularity=("global", "head"),
                                                     bootstrap=bootstrap, seed=seed)
    dilution, drift = _flags(g)
    per_head = [_flags(h, i) for i in np.ndindex(h.mass_ref.shape) if np.isfinite(h.mass_ref[i])]
    one = int(np.argmin(np.abs(g.alpha - 1.0)))

    def num(x):
        x = float(x)
        return x if np.isfinite(x) else None

    notes = []
    if not g.tested:
        notes.append(f"no distance past the seen window W = {window} was measured (longest row {g.n}): "
                     "drift is not judged; the verdict reads dilution only")
    if fit.sequences < 2 or bootstrap == 0:
        notes.append("no intervals (one sequence, or no bootstrap): the thresholds are applied to point values")
    if g.tested and num(g.high("level")) is not None and g.high("level") < -LEVEL_THRESHOLD:
        notes.append("the unseen keys weigh less than half what the seen profile predicts: the continuation "
                     "overstates dilution past W")
    return Verdict(
        verdict=_label(dilution, drift), n=g.n, window=g.window, n_ref=fit.n_ref, mass_ref=float(g.mass_ref),
        mass_continued=float(g.mass_continued[one]), mass_measured=float(g.mass_measured[one]),
        dilution=float(g.value("dilution")), dilution_low=num(g.low("dilution")), dilution_high=num(g.high("dilution")),
        drift=num(g.value("drift")), level=num(g.value("level")), level_low=num(g.low("level")),
        level_high=num(g.high("level")), level_fix=num(g.value("level_fix")), level_fix_low=num(g.low("level_fix")),
        tilt=num(g.value("tilt")), tilt_low=num(g.low("tilt")), tilt_high=num(g.high("tilt")),
        alpha_continued=num(g.alpha_continued), heads=len(per_head),
        heads_drift=sum(d for _, d in per_head), heads_dilution=sum(d for d, _ in per_head),
        note="; ".join(notes) or None)
