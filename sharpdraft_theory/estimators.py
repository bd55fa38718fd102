"""Slope estimators on per-row statistics of real attention logits (theory.md section 6).

Rows come from causal prefill, so one sequence yields rows at every n. Rows are binned into
half-octave buckets of ``n / n_ref``; reference rows have ``n`` in ``(n_ref / 2, n_ref]``.

* **E1, mass matching** (``mass-matching``, the default): the reference mass ``M_ref`` is the
  mean top-k mass at ``a = 1`` at ``n = n_ref``, read off a least-squares line of row mass
  against ``ln n`` over the reference rows (the plain mean over the window is the mass near
  ``0.7 n_ref`` and would bias the slope upward by about 20% under the Gaussian model); in each bucket past ``n_ref`` find ``a_b`` with
  mean ``M_k(a_b) = M_ref`` (mean mass is non-decreasing in ``a``, so the crossing is unique;
  linear interpolation on the recorded alpha grid); fit ``a_b - 1 = beta ln(n_b / n_ref)`` by
  least squares through the origin weighted by rows. R^2 is the uncentred one of a fit through
  the origin.
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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import sparse

from .spec import Bucket, EstimatorResult
from .stats import RowStats

__all__ = ["ESTIMATORS", "SlopeFit", "fit_slopes", "bucket_index"]

ESTIMATORS = ("mass-matching", "closed-form", "gaussian")
PER_OCTAVE = 2  # buckets per doubling of n
_ROW_CHUNK = 32768  # rows reduced at a time: bounds the (rows, alpha grid, k) temporaries


def bucket_index(n, n_ref: int) -> np.ndarray:
    """Half-octave bucket of each n: ``ceil(2 log2(n / n_ref))``; reference rows are -1 and 0."""
    return np.ceil(PER_OCTAVE * np.log2(np.asarray(n, dtype=np.float64) / n_ref) - 1e-9).astype(np.int64)


@dataclass(frozen=True)
class SlopeFit:
    """Everything the estimators found."""

    mass_ref: float  # mean top-k mass at alpha = 1 on reference rows
    buckets: tuple[Bucket, ...]  # global buckets: n, rows, mean mass at alpha = 1, matched alpha
    results: tuple[EstimatorResult, ...]  # global result of each estimator, with 95% bootstrap interval
    slopes: dict  # estimator -> float, (layers,) or (layers, heads) at the requested granularity

    def result(self, estimator: str) -> EstimatorResult:
        return next(r for r in self.results if r.estimator == estimator)


# Per-row features, summed per group. Columns after the mass curve:
# _RESOLVED counts rows whose background tilted mean float32 statistics can resolve (see
# RowStats.tilted_means); _GPRIME and _TILT_ERR are summed over those rows only.
_LOG_N, _LOG_SB, _GPRIME, _MU, _S2, _TBAR, _TILT_ERR, _LOGSUM_ERR, _LOG_N2, _MASS1_LOG_N, _RESOLVED, _COUNT = range(12)
_N_FEAT = 12


class _Table:
    """Row features summed per (seq, layer, head, bucket) group; every estimator reads only this."""

    def __init__(self, stats: RowStats, n_ref: int, top_k: int):
        if stats.rows == 0:
            raise ValueError("no statistics rows to fit")
        bucket = bucket_index(stats.n, n_ref)
        keys = np.stack([stats.seq, stats.layer, stats.head, bucket], axis=1).astype(np.int64)
        self.keys, inverse = np.unique(keys, axis=0, return_inverse=True)
        inverse = inverse.ravel()
        n_grid = stats.alpha_grid.size
        self.grid = stats.alpha_grid.astype(np.float64)
        sums = np.zeros((len(self.keys), n_grid + _N_FEAT))
        for start in range(0, stats.rows, _ROW_CHUNK):
            part = stats.select(slice(start, start + _ROW_CHUNK))
            feats = _row_features(part, top_k)
            idx = inverse[start : start + _ROW_CHUNK]
            onehot = sparse.csr_matrix((np.ones(idx.size), (idx, np.arange(idx.size))), shape=(len(self.keys), idx.size))
            sums += onehot @ feats
        self.curve = sums[:, :n_grid]
        self.feat = sums[:, n_grid:]

    def reduce(self, by: np.ndarray, weights: np.ndarray | None = None):
        """Sum groups sharing the key columns ``by``; optional per-group weights (bootstrap)."""
        sub = self.keys[:, by]
        uniq, inv = np.unique(sub, axis=0, return_inverse=True)
        inv = inv.ravel()
        w = np.ones(len(self.keys)) if weights is None else weights
        onehot = sparse.csr_matrix((w, (inv, np.arange(inv.size))), shape=(len(uniq), inv.size))
        return uniq, onehot @ self.curve, onehot @ self.feat


def _row_features(s: RowStats, top_k: int) -> np.ndarray:
    mass = s.mass(top_k)  # (rows, n_alpha)
    log_sb = s.background_log_sum(top_k)
    zbar_t, zbar_b = s.tilted_means(top_k)
    mu, s2 = s.background_moments(top_k)
    n = s.n.astype(np.float64)
    f = np.empty((s.rows, _N_FEAT))
    resolved = np.isfinite(zbar_b)
    f[:, _LOG_N] = np.log(n)
    f[:, _LOG_N2] = np.log(n) ** 2
    f[:, _MASS1_LOG_N] = mass[:, s.index_of_one] * np.log(n)
    f[:, _LOG_SB] = np.where(resolved, log_sb, 0.0)
    f[:, _RESOLVED] = resolved
    f[:, _GPRIME] = np.where(resolved, zbar_t - zbar_b, 0.0)
    f[:, _MU] = mu
    f[:, _S2] = s2
    f[:, _TBAR] = zbar_t
    f[:, _TILT_ERR] = np.where(resolved, zbar_b - (mu + s2), 0.0)
    f[:, _LOGSUM_ERR] = np.where(resolved, np.abs(log_sb - (np.log(n - top_k) + mu + 0.5 * s2)), 0.0)
    f[:, _COUNT] = 1.0
    return np.concatenate([mass, f], axis=1)


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


def _estimate(tab: _Table, n_ref: int, by: list[int], weights=None) -> dict:
    """Point estimates of the three slopes for each group of the key columns ``by`` (+ bucket).

    Returns arrays over groups (the unique values of ``by``), plus global bucket details when
    ``by`` is empty.
    """
    uniq, curve, feat = tab.reduce(np.array(by + [3], dtype=np.int64), weights)
    group_cols = uniq[:, :-1]
    bucket = uniq[:, -1]
    groups, g_inv = np.unique(group_cols, axis=0, return_inverse=True) if by else (np.zeros((1, 0), np.int64),
                                                                                   np.zeros(len(uniq), np.int64))
    g_inv = np.asarray(g_inv).ravel()
    count = feat[:, _COUNT]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_curve = curve / count[:, None]
        ref = (bucket == -1) | (bucket == 0)
        n_groups = len(groups)

        def group_sum(values, mask):
            return np.bincount(g_inv[mask], weights=values[mask], minlength=n_groups)

        ref_count = group_sum(count, ref)
        i1 = int(np.argmin(np.abs(tab.grid - 1.0)))
        # Mean mass at n_ref itself: regress row mass on ln n over the reference window and read it
        # at ln n_ref. (The plain window mean is the mass near 0.7 n_ref and biases beta upward.)
        sx, sxx_ = group_sum(feat[:, _LOG_N], ref), group_sum(feat[:, _LOG_N2], ref)
        sm, smx = group_sum(curve[:, i1], ref), group_sum(feat[:, _MASS1_LOG_N], ref)
        var_x = sxx_ / ref_count - (sx / ref_count) ** 2
        tilt = np.where(var_x > 1e-12, (smx / ref_count - sx * sm / ref_count**2) / np.where(var_x > 1e-12, var_x, 1), 0)
        mass_ref = sm / ref_count + tilt * (np.log(n_ref) - sx / ref_count)

        # E1: mass matching in each bucket past n_ref, then a weighted fit through the origin.
        beyond = bucket >= 1
        a_b = _crossing(mean_curve, mass_ref[g_inv], tab.grid)
        log_nb = feat[:, _LOG_N] / count
        x = log_nb - np.log(n_ref)
        y = a_b - 1.0
        use = beyond & np.isfinite(a_b)
        sxy = group_sum(count * x * np.nan_to_num(y), use)
        sxx = group_sum(count * x * x, use)
        e1 = sxy / sxx
        ss_res = group_sum(count * (np.nan_to_num(y) - e1[g_inv] * x) ** 2, use)
        r2 = 1.0 - ss_res / group_sum(count * np.nan_to_num(y) ** 2, use)
        unreachable = group_sum(np.ones_like(count), beyond & ~np.isfinite(a_b))

        # E2: dilution exponent from the background log-sum, over buckets from the reference on.
        fit = (bucket >= -1) & (feat[:, _RESOLVED] > 0)
        n_res = np.where(fit, feat[:, _RESOLVED], 0.0)
        mean_sb = feat[:, _LOG_SB] / np.where(fit, n_res, 1.0)
        mx = group_sum(n_res * log_nb, fit) / group_sum(n_res, fit)
        my = group_sum(n_res * mean_sb, fit) / group_sum(n_res, fit)
        bx = log_nb - mx[g_inv]
        by_ = mean_sb - my[g_inv]
        gamma = group_sum(n_res * bx * by_, fit) / group_sum(n_res * bx * bx, fit)
        resolved_ref = group_sum(feat[:, _RESOLVED], ref)
        gprime = group_sum(feat[:, _GPRIME], ref) / resolved_ref
        e2 = gamma / gprime

        # E3: Gaussian background fitted on reference rows.
        mu = group_sum(feat[:, _MU], ref) / ref_count
        s2 = group_sum(feat[:, _S2], ref) / ref_count
        tbar = group_sum(feat[:, _TBAR], ref) / ref_count
        denom = tbar - mu - s2
        e3 = np.where(denom > 0, 1.0 / denom, np.nan)
        tilt_err = group_sum(feat[:, _TILT_ERR], ref) / resolved_ref
        logsum_err = group_sum(feat[:, _LOGSUM_ERR], ref) / resolved_ref
    out = dict(groups=groups, mass_ref=mass_ref, e1=e1, e2=e2, e3=e3, r2=r2, gamma=gamma, gprime=gprime,
               mu=mu, s2=s2, tbar=tbar, tilt_err=tilt_err, logsum_err=logsum_err, unreachable=unreachable,
               ref_rows=ref_count, unresolved_ref_rows=ref_count - resolved_ref, beyond_rows=group_sum(count, beyond))
    if not by:
        out["buckets"] = tuple(
            Bucket(n=float(np.exp(log_nb[j])), rows=int(count[j]), mass=float(mean_curve[j, i1]),
                   alpha=float(a_b[j]) if beyond[j] and np.isfinite(a_b[j]) else None)
            for j in np.argsort(bucket))
    return out


def _finite_or_none(v) -> float | None:
    v = float(v)
    return v if np.isfinite(v) else None


def fit_slopes(stats: RowStats, *, n_ref: int, top_k: int, granularity: str = "global", bootstrap: int = 200,
               seed: int = 0) -> SlopeFit:
    """Fit the query-scaling slope with E1, E2 and E3.

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
    tab = _Table(stats, n_ref, top_k)
    point = _estimate(tab, n_ref, [])
    names = {"mass-matching": "e1", "closed-form": "e2", "gaussian": "e3"}

    # Bootstrap over sequences: multinomial weights per sequence, applied to every group of it.
    seqs, seq_of_group = np.unique(tab.keys[:, 0], return_inverse=True)
    boot = {k: np.array([]) for k in names.values()}
    if bootstrap > 0 and seqs.size > 1:
        rng = np.random.default_rng(seed)
        draws = rng.multinomial(seqs.size, np.full(seqs.size, 1.0 / seqs.size), size=bootstrap)
        samples = [_estimate(tab, n_ref, [], weights=draws[b][seq_of_group.ravel()].astype(np.float64))
                   for b in range(bootstrap)]
        boot = {k: np.array([float(s[k][0]) for s in samples]) for k in names.values()}

    def interval(key):
        finite = boot[key][np.isfinite(boot[key])]
        if finite.size < max(10, 0.5 * bootstrap):
            return None, None
        lo, hi = np.percentile(finite, [2.5, 97.5])
        return float(lo), float(hi)

    results = []
    for est, key in names.items():
        lo, hi = interval(key)
        diag = {"reference_rows": float(point["ref_rows"][0]), "rows_past_n_ref": float(point["beyond_rows"][0])}
        note = None
        if key == "e1":
            diag |= {"r2": _finite_or_none(point["r2"][0]), "unreachable_buckets": float(point["unreachable"][0])}
            if point["unreachable"][0]:
                note = "the reference mass is out of the alpha grid's reach in some buckets (left out of the fit)"
        elif key == "e2":
            diag |= {"gamma": _finite_or_none(point["gamma"][0]), "g_prime": _finite_or_none(point["gprime"][0]),
                     "sink_rows_left_out": float(point["unresolved_ref_rows"][0])}
        else:
            diag |= {"mu": _finite_or_none(point["mu"][0]), "sigma2": _finite_or_none(point["s2"][0]),
                     "tbar": _finite_or_none(point["tbar"][0]),
                     "tilted_mean_error": _finite_or_none(point["tilt_err"][0]),
                     "log_sum_error": _finite_or_none(point["logsum_err"][0])}
            if not np.isfinite(point["e3"][0]):
                note = "tbar - mu - sigma^2 <= 0: the top set is not above the tilted Gaussian background"
        if seqs.size < 2 and bootstrap > 0:
            note = (note + "; " if note else "") + "one sequence: no bootstrap interval"
        results.append(EstimatorResult(estimator=est, slope=_finite_or_none(point[key][0]), ci_low=lo, ci_high=hi,
                                       diagnostics=diag, note=note))

    slopes = {est: float(point[key][0]) for est, key in names.items()}
    if granularity != "global":
        by = [1] if granularity == "layer" else [1, 2]
        grouped = _estimate(tab, n_ref, by)
        layers = int(stats.layer.max()) + 1
        heads = int(stats.head.max()) + 1
        for est, key in names.items():
            shape = (layers,) if granularity == "layer" else (layers, heads)
            arr = np.full(shape, np.nan)
            idx = tuple(grouped["groups"].T)
            arr[idx] = grouped[key]
            missing = ~np.isfinite(arr)
            arr[missing] = slopes[est]
            slopes[est] = arr
            r = next(x for x in results if x.estimator == est)
            r.diagnostics["groups_filled"] = float(missing.sum())
    return SlopeFit(mass_ref=float(point["mass_ref"][0]), buckets=point["buckets"], results=tuple(results),
                    slopes=slopes)
