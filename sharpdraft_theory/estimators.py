"""Slope estimators on per-row statistics of real attention logits (theory.md section 6).

Rows come from causal prefill, so one sequence yields rows at every n. Rows are binned into
half-octave buckets of ``n / n_ref``; reference rows have ``n`` in ``(n_ref / 2, n_ref]``.

* **E1, mass matching** (``mass-matching``, the default): the reference mass ``M_ref`` is the
  mean top-k mass at ``a = 1`` at ``n = n_ref``, read off a least-squares line of row mass
  against ``ln n`` over the reference rows (the plain mean over the window is the mass near
  ``0.7 n_ref`` and would bias the slope upward by about 20% under the Gaussian model); in each
  bucket past ``n_ref`` find ``a_b`` with mean ``M_k(a_b) = M_ref`` (mean mass is non-decreasing
  in ``a``, so the crossing is unique; linear interpolation on the recorded alpha grid); fit
  ``a_b - 1 = beta ln(n_b / n_ref)`` by least squares through the origin weighted by rows. R^2 is
  the uncentred one of a fit through the origin.
* **E2, closed form** (``closed-form``): the dilution exponent ``gamma`` is the slope of the mean
  background log-sum ``ln S_B(1)`` against ``ln n`` over buckets from the reference on;
  ``beta = gamma / mean g'(1)`` with ``g'(1) = zbar_T(1) - zbar_B(1)`` on reference rows.
  Attention-sink rows whose background holds under 0.1% of the mass are left out of E2 and of
  the E3 diagnostics: float32 statistics cannot resolve their background (``RowStats.tilted_means``).
* **E3, Gaussian fit** (``gaussian``): background mean ``mu`` and variance ``s^2`` and the top
  set's softmax-weighted mean ``tbar`` on reference rows; ``beta = 1 / (tbar - mu - s^2)``.
  Goodness of fit: how far the observed tilted background mean is from the Gaussian ``mu + s^2``
  and how far ``ln S_B(1)`` is from the annealed Gaussian ``ln(n - k) + mu + s^2 / 2`` (nats).

Confidence intervals are 95% percentile bootstraps over sequences (rows of one sequence are
correlated, so sequences are the independent unit). All three are reported; the spec uses one.

How it is built: rows are summed once per (sequence, layer, head, bucket) into a table of named
sums (``_Sums``); a fit reduces the table to (group, bucket) cells (``_Cells``), optionally with
bootstrap weights, and each estimator is one function of the cells returning a small frozen
result. :data:`REGISTRY` names the estimators (canonical name, short label, spellings accepted
on input) and holds their functions; the CLI's ``--estimator`` and the spec's calibration record
both read it. :class:`Bucket` and :class:`EstimatorResult` are the records the spec stores.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable

import numpy as np
from scipy import sparse

from .checks import check_int, check_num, check_record, check_str, field_error
from .stats import RowStats

__all__ = ["Estimator", "REGISTRY", "ESTIMATORS", "ESTIMATOR_CHOICES", "get_estimator", "Bucket", "EstimatorResult",
           "SlopeFit", "fit_slopes", "bucket_index"]

PER_OCTAVE = 2  # buckets per doubling of n
_ROW_CHUNK = 32768  # rows reduced at a time: bounds the (rows, alpha grid, k) temporaries


# -- records stored in the spec's calibration record ------------------------------------------------------------------
@dataclass(frozen=True)
class Bucket:
    """One context-length bucket of the calibration corpus."""

    n: float  # representative visible-key count (geometric mean of the bucket's rows)
    rows: int  # attention rows (query, layer, head) in the bucket
    mass: float  # mean top-k mass at alpha = 1
    alpha: float | None  # mass-matching alpha that restores the reference mass (None: n <= n_ref or unreachable)

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "Bucket":
        check_record(where, d, cls)
        mass = check_num(f"{where}.mass", d["mass"], 0.0)
        if mass > 1:
            raise field_error(f"{where}.mass", "expected a mass in [0, 1]", mass)
        return cls(n=check_num(f"{where}.n", d["n"], 1.0), rows=check_int(f"{where}.rows", d["rows"], 0), mass=mass,
                   alpha=check_num(f"{where}.alpha", d["alpha"], 0.0, nullable=True))


@dataclass(frozen=True)
class EstimatorResult:
    """One slope estimator's global result (theory.md section 6)."""

    estimator: str  # canonical estimator name (a name in ESTIMATORS)
    slope: float | None  # fitted slope beta; None when the estimator is undefined on this data
    ci_low: float | None  # lower end of the 95% bootstrap interval over sequences
    ci_high: float | None  # upper end of that interval
    diagnostics: dict = field(default_factory=dict)  # fit quality: r2, gamma, gof, ... (name -> number)
    note: str | None = None  # why the slope is missing or doubtful

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "EstimatorResult":
        check_record(where, d, cls)
        diag = d.get("diagnostics", {})
        if not isinstance(diag, dict):
            raise field_error(f"{where}.diagnostics", "expected an object of numbers", diag)
        for key, value in diag.items():
            check_num(f"{where}.diagnostics.{key}", value, nullable=True)
        return cls(
            estimator=check_str(f"{where}.estimator", d["estimator"], ESTIMATORS),
            slope=check_num(f"{where}.slope", d["slope"], nullable=True),
            ci_low=check_num(f"{where}.ci_low", d["ci_low"], nullable=True),
            ci_high=check_num(f"{where}.ci_high", d["ci_high"], nullable=True),
            diagnostics=dict(diag),
            note=check_str(f"{where}.note", d.get("note"), nullable=True),
        )


def bucket_index(n, n_ref: int) -> np.ndarray:
    """Half-octave bucket of each n: ``ceil(2 log2(n / n_ref))``; reference rows are -1 and 0."""
    return np.ceil(PER_OCTAVE * np.log2(np.asarray(n, dtype=np.float64) / n_ref) - 1e-9).astype(np.int64)


# -- the table of row sums every estimator reads ----------------------------------------------------------------------
@dataclass(frozen=True)
class _Sums:
    """Per-row features summed over a set of rows; each field has one entry per set (shape (sets,)).

    "Resolved" rows are those whose background tilted mean float32 statistics can resolve
    (``RowStats.tilted_means``); the fields that say so are summed over those rows only.
    """

    count: np.ndarray  # rows
    log_n: np.ndarray  # sum of ln n
    log_n2: np.ndarray  # sum of (ln n)^2
    mass1_log_n: np.ndarray  # sum of M_k(1) ln n
    resolved: np.ndarray  # resolved rows
    log_sb: np.ndarray  # sum of ln S_B(1), resolved rows
    g_prime: np.ndarray  # sum of zbar_T(1) - zbar_B(1), resolved rows
    mu: np.ndarray  # sum of the background mean
    s2: np.ndarray  # sum of the background variance
    tbar: np.ndarray  # sum of the top set's tilted mean zbar_T(1)
    tilt_err: np.ndarray  # sum of zbar_B(1) - (mu + s2), resolved rows
    logsum_err: np.ndarray  # sum of |ln S_B(1) - (ln(n - k) + mu + s2 / 2)|, resolved rows

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def of_columns(cls, matrix: np.ndarray) -> "_Sums":
        """Name the columns of a (sets, features) matrix laid out in field order."""
        return cls(**{name: matrix[:, i] for i, name in enumerate(cls.names())})


def _row_features(s: RowStats, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row features: the mass curve (rows, n_alpha) and the ``_Sums`` features (rows, features)."""
    mass = s.mass(top_k)  # (rows, n_alpha)
    log_sb = s.background_log_sum(top_k)
    zbar_t, zbar_b = s.tilted_means(top_k)
    mu, s2 = s.background_moments(top_k)
    log_n = np.log(s.n.astype(np.float64))
    resolved = np.isfinite(zbar_b)
    cols = dict(
        count=np.ones(s.rows), log_n=log_n, log_n2=log_n**2, mass1_log_n=mass[:, s.index_of_one] * log_n,
        resolved=resolved.astype(np.float64), log_sb=np.where(resolved, log_sb, 0.0),
        g_prime=np.where(resolved, zbar_t - zbar_b, 0.0), mu=mu, s2=s2, tbar=zbar_t,
        tilt_err=np.where(resolved, zbar_b - (mu + s2), 0.0),
        logsum_err=np.where(resolved, np.abs(log_sb - (np.log(s.n.astype(np.float64) - top_k) + mu + 0.5 * s2)), 0.0))
    return mass, np.column_stack([cols[name] for name in _Sums.names()])


def _group_onehot(inverse: np.ndarray, groups: int, weights=None) -> sparse.csr_matrix:
    """(groups, items) matrix summing items into their group (with optional per-item weights)."""
    w = np.ones(inverse.size) if weights is None else weights
    return sparse.csr_matrix((w, (inverse, np.arange(inverse.size))), shape=(groups, inverse.size))


@dataclass(frozen=True)
class _Table:
    """Row features summed per (seq, layer, head, bucket) group; every estimator reads only this."""

    keys: np.ndarray  # (groups, 4) int64: seq, layer, head, bucket
    grid: np.ndarray  # (n_alpha,) alpha grid of the statistics
    curve: np.ndarray  # (groups, n_alpha) summed top-k mass M_k(a)
    features: np.ndarray  # (groups, features) summed features, columns in _Sums field order

    SEQ, LAYER, HEAD, BUCKET = range(4)  # key columns

    @classmethod
    def of_rows(cls, stats: RowStats, n_ref: int, top_k: int) -> "_Table":
        if stats.rows == 0:
            raise ValueError("no statistics rows to fit")
        bucket = bucket_index(stats.n, n_ref)
        keys = np.stack([stats.seq, stats.layer, stats.head, bucket], axis=1).astype(np.int64)
        keys, inverse = np.unique(keys, axis=0, return_inverse=True)
        inverse = inverse.ravel()
        curve = np.zeros((len(keys), stats.alpha_grid.size))
        feats = np.zeros((len(keys), len(_Sums.names())))
        for start in range(0, stats.rows, _ROW_CHUNK):
            part_curve, part_feats = _row_features(stats.select(slice(start, start + _ROW_CHUNK)), top_k)
            onehot = _group_onehot(inverse[start : start + _ROW_CHUNK], len(keys))
            curve += onehot @ part_curve
            feats += onehot @ part_feats
        return cls(keys=keys, grid=stats.alpha_grid.astype(np.float64), curve=curve, features=feats)

    def cells(self, by: tuple[int, ...], weights: np.ndarray | None = None) -> "_Cells":
        """Sum the table into (group, bucket) cells, groups being the key columns ``by``.

        ``by = ()`` is one global group; ``weights`` (one per table group) are bootstrap weights.
        """
        cols = np.array(by + (self.BUCKET,), dtype=np.int64)
        uniq, inverse = np.unique(self.keys[:, cols], axis=0, return_inverse=True)
        onehot = _group_onehot(inverse.ravel(), len(uniq), weights)
        if by:
            groups, group = np.unique(uniq[:, :-1], axis=0, return_inverse=True)
        else:
            groups, group = np.zeros((1, 0), np.int64), np.zeros(len(uniq), np.int64)
        return _Cells(groups=groups, group=np.asarray(group).ravel(), bucket=uniq[:, -1], grid=self.grid,
                      curve=onehot @ self.curve, sums=_Sums.of_columns(onehot @ self.features))


@dataclass(frozen=True)
class _Cells:
    """The table summed into (group, bucket) cells: the input of every estimator."""

    groups: np.ndarray  # (G, len(by)) key values of each group; one empty row for a global fit
    group: np.ndarray  # (cells,) group index of each cell
    bucket: np.ndarray  # (cells,) half-octave bucket of each cell
    grid: np.ndarray  # (n_alpha,) alpha grid
    curve: np.ndarray  # (cells, n_alpha) summed top-k mass M_k(a)
    sums: _Sums  # (cells,) summed features

    def group_sum(self, values: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Sum of ``values`` over the cells of each group where ``mask``: shape (G,)."""
        return np.bincount(self.group[mask], weights=values[mask], minlength=len(self.groups))

    @property
    def reference(self) -> np.ndarray:
        """(cells,) bool: the reference window ``(n_ref / 2, n_ref]``."""
        return (self.bucket == -1) | (self.bucket == 0)

    @property
    def beyond(self) -> np.ndarray:
        """(cells,) bool: past ``n_ref``."""
        return self.bucket >= 1

    @property
    def mean_log_n(self) -> np.ndarray:
        """(cells,) mean ``ln n`` of each cell."""
        return self.sums.log_n / self.sums.count

    @property
    def index_of_one(self) -> int:
        return int(np.argmin(np.abs(self.grid - 1.0)))


def _crossing(curves: np.ndarray, target: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """First grid-interpolated ``a`` where each non-decreasing curve reaches ``target``; NaN if never.

    curves: (..., n_alpha); target broadcastable to curves.shape[:-1].
    """
    target = np.broadcast_to(np.asarray(target, dtype=np.float64), curves.shape[:-1])[..., None]
    above = curves >= target
    i = np.argmax(above, axis=-1)  # first index at or above the target
    ok = above.any(axis=-1) & (i > 0)
    lo = np.clip(i - 1, 0, grid.size - 1)
    c_lo = np.take_along_axis(curves, lo[..., None], -1)[..., 0]
    c_hi = np.take_along_axis(curves, i[..., None], -1)[..., 0]
    t = target[..., 0]
    frac = np.where(c_hi > c_lo, (t - c_lo) / np.where(c_hi > c_lo, c_hi - c_lo, 1.0), 0.0)
    return np.where(ok, grid[lo] + frac * (grid[i] - grid[lo]), np.nan)


def _value(v) -> float | None:
    """A float for the record; None when not finite."""
    v = float(v)
    return v if np.isfinite(v) else None


# -- the estimators: one function of the cells each, one frozen result each (arrays over groups) ---------------------
@dataclass(frozen=True)
class MassMatching:
    """E1 per group."""

    slope: np.ndarray  # (G,) beta of a_b - 1 = beta ln(n_b / n_ref), row-weighted, through the origin
    mass_ref: np.ndarray  # (G,) mean top-k mass at n = n_ref, a = 1
    r2: np.ndarray  # (G,) uncentred R^2 of that fit
    unreachable: np.ndarray  # (G,) buckets past n_ref whose mass_ref is out of the alpha grid's reach
    alpha: np.ndarray  # (cells,) matched a_b; NaN at or below n_ref and where unreachable

    def diagnostics(self) -> dict:
        return {"r2": _value(self.r2[0]), "unreachable_buckets": float(self.unreachable[0])}

    def note(self) -> str | None:
        if self.unreachable[0]:
            return "the reference mass is out of the alpha grid's reach in some buckets (left out of the fit)"
        return None


def mass_matching(cells: _Cells, n_ref: int) -> MassMatching:
    """E1: match the reference mass bucket by bucket, then fit the law through the matched alphas."""
    s, g, ref, beyond = cells.sums, cells.group, cells.reference, cells.beyond
    mass1 = cells.curve[:, cells.index_of_one]
    with np.errstate(invalid="ignore", divide="ignore"):
        ref_count = cells.group_sum(s.count, ref)
        # Mean mass at n_ref itself: regress row mass on ln n over the reference window and read it
        # at ln n_ref. (The plain window mean is the mass near 0.7 n_ref and biases beta upward.)
        sx, sxx_ = cells.group_sum(s.log_n, ref), cells.group_sum(s.log_n2, ref)
        sm, smx = cells.group_sum(mass1, ref), cells.group_sum(s.mass1_log_n, ref)
        var_x = sxx_ / ref_count - (sx / ref_count) ** 2
        tilt = np.where(var_x > 1e-12,
                        (smx / ref_count - sx * sm / ref_count**2) / np.where(var_x > 1e-12, var_x, 1), 0)
        mass_ref = sm / ref_count + tilt * (np.log(n_ref) - sx / ref_count)

        a_b = np.where(beyond, _crossing(cells.curve / s.count[:, None], mass_ref[g], cells.grid), np.nan)
        x = cells.mean_log_n - np.log(n_ref)
        y = a_b - 1.0
        use = np.isfinite(a_b)
        sxy = cells.group_sum(s.count * x * np.nan_to_num(y), use)
        sxx = cells.group_sum(s.count * x * x, use)
        slope = sxy / sxx
        ss_res = cells.group_sum(s.count * (np.nan_to_num(y) - slope[g] * x) ** 2, use)
        r2 = 1.0 - ss_res / cells.group_sum(s.count * np.nan_to_num(y) ** 2, use)
    unreachable = cells.group_sum(np.ones_like(s.count), beyond & ~use)
    return MassMatching(slope=slope, mass_ref=mass_ref, r2=r2, unreachable=unreachable, alpha=a_b)


@dataclass(frozen=True)
class ClosedForm:
    """E2 per group."""

    slope: np.ndarray  # (G,) beta = gamma / g'(1)
    gamma: np.ndarray  # (G,) dilution exponent: slope of mean ln S_B(1) against ln n
    g_prime: np.ndarray  # (G,) mean zbar_T(1) - zbar_B(1) on resolved reference rows
    sink_rows: np.ndarray  # (G,) reference rows left out (background unresolved)

    def diagnostics(self) -> dict:
        return {"gamma": _value(self.gamma[0]), "g_prime": _value(self.g_prime[0]),
                "sink_rows_left_out": float(self.sink_rows[0])}

    def note(self) -> str | None:
        return None


def closed_form(cells: _Cells, n_ref: int) -> ClosedForm:
    """E2: the dilution exponent over buckets from the reference on, over g'(1) on reference rows."""
    s, g, ref = cells.sums, cells.group, cells.reference
    with np.errstate(invalid="ignore", divide="ignore"):
        log_nb = cells.mean_log_n
        fit = (cells.bucket >= -1) & (s.resolved > 0)
        n_res = np.where(fit, s.resolved, 0.0)
        mean_sb = s.log_sb / np.where(fit, n_res, 1.0)
        mx = cells.group_sum(n_res * log_nb, fit) / cells.group_sum(n_res, fit)
        my = cells.group_sum(n_res * mean_sb, fit) / cells.group_sum(n_res, fit)
        bx = log_nb - mx[g]
        by = mean_sb - my[g]
        gamma = cells.group_sum(n_res * bx * by, fit) / cells.group_sum(n_res * bx * bx, fit)
        resolved_ref = cells.group_sum(s.resolved, ref)
        g_prime = cells.group_sum(s.g_prime, ref) / resolved_ref
        slope = gamma / g_prime
    return ClosedForm(slope=slope, gamma=gamma, g_prime=g_prime,
                      sink_rows=cells.group_sum(s.count, ref) - resolved_ref)


@dataclass(frozen=True)
class GaussianFit:
    """E3 per group."""

    slope: np.ndarray  # (G,) beta = 1 / (tbar - mu - s2); NaN where that is not positive
    mu: np.ndarray  # (G,) mean background logit on reference rows
    sigma2: np.ndarray  # (G,) mean background variance on reference rows
    tbar: np.ndarray  # (G,) mean tilted mean of the top set on reference rows
    tilted_mean_error: np.ndarray  # (G,) mean zbar_B(1) - (mu + s2) on resolved reference rows
    log_sum_error: np.ndarray  # (G,) mean |ln S_B(1) - annealed Gaussian| (nats) on resolved reference rows

    def diagnostics(self) -> dict:
        return {"mu": _value(self.mu[0]), "sigma2": _value(self.sigma2[0]), "tbar": _value(self.tbar[0]),
                "tilted_mean_error": _value(self.tilted_mean_error[0]), "log_sum_error": _value(self.log_sum_error[0])}

    def note(self) -> str | None:
        if not np.isfinite(self.slope[0]):
            return "tbar - mu - sigma^2 <= 0: the top set is not above the tilted Gaussian background"
        return None


def gaussian_fit(cells: _Cells, n_ref: int) -> GaussianFit:
    """E3: a Gaussian background fitted on reference rows."""
    s, ref = cells.sums, cells.reference
    with np.errstate(invalid="ignore", divide="ignore"):
        ref_count = cells.group_sum(s.count, ref)
        resolved_ref = cells.group_sum(s.resolved, ref)
        mu = cells.group_sum(s.mu, ref) / ref_count
        s2 = cells.group_sum(s.s2, ref) / ref_count
        tbar = cells.group_sum(s.tbar, ref) / ref_count
        denom = tbar - mu - s2
        slope = np.where(denom > 0, 1.0 / denom, np.nan)
        tilt_err = cells.group_sum(s.tilt_err, ref) / resolved_ref
        logsum_err = cells.group_sum(s.logsum_err, ref) / resolved_ref
    return GaussianFit(slope=slope, mu=mu, sigma2=s2, tbar=tbar, tilted_mean_error=tilt_err, log_sum_error=logsum_err)


# -- the registry ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimator:
    """One slope estimator: its names and its function."""

    name: str  # canonical name: the spec's calibration.estimator, the keys of SlopeFit.slopes
    label: str  # short label in tables and figures (E1, E2, ...)
    aliases: tuple[str, ...]  # further spellings accepted on input (name and label always are; case is ignored)
    fit: Callable  # (cells, n_ref) -> frozen result with a (groups,) `slope`, `diagnostics()` and `note()`


REGISTRY: dict[str, Estimator] = {e.name: e for e in (
    Estimator("mass-matching", "E1", ("mass_matching",), mass_matching),
    Estimator("closed-form", "E2", ("closed_form",), closed_form),
    Estimator("gaussian", "E3", ("gaussian-fit", "gaussian_fit"), gaussian_fit),
)}

#: Canonical names, in the order results are reported.
ESTIMATORS = tuple(REGISTRY)
#: The names with their labels, for help texts and error messages.
ESTIMATOR_CHOICES = ", ".join(f"{e.name} ({e.label})" for e in REGISTRY.values())
_SPELLINGS = {spelling.lower(): e for e in REGISTRY.values() for spelling in (e.name, e.label, *e.aliases)}


def get_estimator(name: str) -> Estimator:
    """The registry entry for a canonical name, label or alias, in any case.

    Examples
    --------
    >>> get_estimator("E1").name
    'mass-matching'
    >>> get_estimator("Closed_Form").label
    'E2'
    """
    entry = _SPELLINGS.get(name.strip().lower()) if isinstance(name, str) else None
    if entry is None:
        raise ValueError(f"unknown estimator {name!r}; choose one of {ESTIMATOR_CHOICES}")
    return entry


# -- the fit ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SlopeFit:
    """Everything the estimators found."""

    mass_ref: float  # mean top-k mass at alpha = 1 on reference rows
    buckets: tuple[Bucket, ...]  # global buckets: n, rows, mean mass at alpha = 1, matched alpha
    results: tuple[EstimatorResult, ...]  # global result of each estimator, with 95% bootstrap interval
    slopes: dict  # estimator -> float, (layers,) or (layers, heads) at the requested granularity
    bucket_alpha: np.ndarray  # E1's alpha per bucket of `buckets` at the granularity (a buckets axis last); NaN: none

    def result(self, estimator: str) -> EstimatorResult:
        """The result of ``estimator`` (any accepted spelling)."""
        name = get_estimator(estimator).name
        return next(r for r in self.results if r.estimator == name)


def _buckets(cells: _Cells, e1: MassMatching) -> tuple[Bucket, ...]:
    """Global buckets in order of n, from the cells of a global fit."""
    mass1 = cells.curve[:, cells.index_of_one] / cells.sums.count
    return tuple(Bucket(n=float(np.exp(cells.mean_log_n[j])), rows=int(cells.sums.count[j]), mass=float(mass1[j]),
                        alpha=_value(e1.alpha[j]))
                 for j in np.argsort(cells.bucket))


def _interval(samples: np.ndarray, bootstrap: int) -> tuple[float | None, float | None]:
    """95% percentile interval of the finite bootstrap samples; None when too few are finite."""
    finite = samples[np.isfinite(samples)]
    if finite.size < max(10, 0.5 * bootstrap):
        return None, None
    lo, hi = np.percentile(finite, [2.5, 97.5])
    return float(lo), float(hi)


def _grouped(table: _Table, n_ref: int, granularity: str, fallback: dict, layers: int, heads: int,
             buckets: np.ndarray):
    """Per-layer or per-head slopes of every estimator; groups where one is undefined take ``fallback``.

    Returns ``{name: array}``, ``{name: groups filled}`` and E1's matched alpha per group and
    bucket (``buckets``: the global buckets' indices in order; NaN where a group has none).
    """
    by = (_Table.LAYER,) if granularity == "layer" else (_Table.LAYER, _Table.HEAD)
    shape = (layers,) if granularity == "layer" else (layers, heads)
    cells = table.cells(by)
    slopes, filled = {}, {}
    for name, est in REGISTRY.items():
        found = est.fit(cells, n_ref)
        arr = np.full(shape, np.nan)
        arr[tuple(cells.groups.T)] = found.slope
        missing = ~np.isfinite(arr)
        slopes[name] = np.where(missing, fallback[name], arr)
        filled[name] = float(missing.sum())
        if name == "mass-matching":
            alpha = np.full(shape + (buckets.size,), np.nan)
            alpha[tuple(cells.groups[cells.group].T) + (np.searchsorted(buckets, cells.bucket),)] = found.alpha
    return slopes, filled, alpha


def fit_slopes(stats: RowStats, *, n_ref: int, top_k: int, granularity: str = "global", bootstrap: int = 200,
               seed: int = 0) -> SlopeFit:
    """Fit the query-scaling slope with every estimator of the registry (E1, E2, E3).

    Parameters
    ----------
    stats : RowStats
        Per-row statistics (from calibration or ``row_stats_from_logits``).
    n_ref : int
        Reference length: rows with n in ``(n_ref / 2, n_ref]`` define the reference mass.
    top_k : int
        Size of the top set (``<= stats.k_max``).
    granularity : {"global", "layer", "head"}
        Shape of the returned ``slopes``: one value, one per layer, one per (layer, head). Groups
        where an estimator is undefined (no rows past n_ref, mass unreachable on the grid) take
        the global value; how many did is in the diagnostics (``groups_filled``).
    bootstrap : int
        Bootstrap resamples of sequences for the global intervals (0: none).
    """
    if granularity not in ("global", "layer", "head"):
        raise ValueError(f"granularity must be global, layer or head, got {granularity!r}")
    if np.any(stats.n <= top_k):
        stats = stats.select(stats.n > top_k)
    ref_rows = np.count_nonzero((stats.n > n_ref / 2) & (stats.n <= n_ref))
    if ref_rows == 0:
        raise ValueError(f"no rows with n in ({n_ref // 2}, {n_ref}]: n_ref={n_ref} is outside the measured "
                         f"lengths {int(stats.n.min())}..{int(stats.n.max())}; choose an n_ref inside them")
    if not np.any(stats.n > n_ref):
        raise ValueError(f"no rows with n > n_ref={n_ref} (longest is {int(stats.n.max())}): use longer sequences "
                         "or a smaller n_ref")
    table = _Table.of_rows(stats, n_ref, top_k)
    cells = table.cells(())
    point = {name: est.fit(cells, n_ref) for name, est in REGISTRY.items()}
    e1 = point["mass-matching"]

    # Bootstrap over sequences: multinomial weights per sequence, applied to every group of it.
    seqs, seq_of_group = np.unique(table.keys[:, _Table.SEQ], return_inverse=True)
    boot = {name: np.array([]) for name in REGISTRY}
    if bootstrap > 0 and seqs.size > 1:
        rng = np.random.default_rng(seed)
        draws = rng.multinomial(seqs.size, np.full(seqs.size, 1.0 / seqs.size), size=bootstrap)
        resampled = [table.cells((), weights=draw[seq_of_group.ravel()].astype(np.float64)) for draw in draws]
        boot = {name: np.array([float(est.fit(c, n_ref).slope[0]) for c in resampled])
                for name, est in REGISTRY.items()}

    slopes = {name: float(point[name].slope[0]) for name in REGISTRY}
    filled = {}
    order = np.argsort(cells.bucket)  # the global buckets in order of n
    bucket_alpha = e1.alpha[order]
    if granularity != "global":
        slopes, filled, bucket_alpha = _grouped(table, n_ref, granularity, slopes, int(stats.layer.max()) + 1,
                                                int(stats.head.max()) + 1, cells.bucket[order])

    common = {"reference_rows": float(cells.group_sum(cells.sums.count, cells.reference)[0]),
              "rows_past_n_ref": float(cells.group_sum(cells.sums.count, cells.beyond)[0])}
    results = []
    for name, found in point.items():
        note = found.note()
        if seqs.size < 2 and bootstrap > 0:
            note = (note + "; " if note else "") + "one sequence: no bootstrap interval"
        diagnostics = {**common, **found.diagnostics(), **({"groups_filled": filled[name]} if filled else {})}
        results.append(EstimatorResult(name, _value(found.slope[0]), *_interval(boot[name], bootstrap),
                                       diagnostics=diagnostics, note=note))
    return SlopeFit(mass_ref=float(e1.mass_ref[0]), buckets=_buckets(cells, e1), results=tuple(results),
                    slopes=slopes, bucket_alpha=bucket_alpha)
