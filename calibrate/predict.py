"""``sharpdraft predict``: dilution and its correction under a score model, or from measured statistics."""

from __future__ import annotations

import math

import numpy as np

from scipy.special import expit

from sharpdraft_theory import (Gaussian, TwoLevel, alpha_law, annealed_mass, dilution_mass, exact_alpha,
                               least_squares_slope, monte_carlo_mass, regime, tangent_slope)
from sharpdraft_theory.laws import MAX_N

from .errors import UserError

__all__ = ["predict", "predict_from_stats", "head_laws"]

MC_MAX_N = 1 << 22
# Monte Carlo draws rows x n logits per length: 2^30 of them take about 10 s on one core, and by then
# the standard error of the mean mass (~ 1 / sqrt(rows)) is far below what the table shows.
MC_MAX_DRAWS = 1 << 30


def _model(model: str, gap: float, sigma: float | None, top_k: int):
    try:
        if model == "two-level":
            if sigma is not None:
                raise UserError("--sigma applies to --model gaussian only; drop it or choose gaussian")
            return TwoLevel(gap=gap, top_k=top_k)
        if model == "gaussian":
            if sigma is None:
                raise UserError("--model gaussian needs --sigma (the background logits' standard deviation)")
            if gap <= sigma**2:
                raise UserError(f"--gap {gap:g} must exceed sigma^2 = {sigma**2:g} for the Gaussian correction "
                                "(the top set must stand above the tilted background)")
            return Gaussian(gap=gap, sigma=sigma, top_k=top_k)
    except ValueError as err:
        raise UserError(str(err)) from None
    raise UserError(f"--model {model!r} is not known; choose two-level or gaussian")


def predict(*, model: str, gap: float, sigma: float | None, top_k: int, n_ref: int, n: list[int],
            mc_rows: int = 0, seed: int = 0) -> dict:
    """Everything ``sharpdraft predict`` shows, as a JSON-ready dict.

    Masses are annealed predictions, or quenched Monte Carlo means when ``mc_rows > 0``.
    """
    for option, value in (("--gap", gap), ("--sigma", sigma)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise UserError(f"{option} {value:g}: expected a finite number > 0")
    if top_k < 1:
        raise UserError(f"--top-k {top_k}: need at least 1")
    if not top_k < n_ref <= MAX_N:
        raise UserError(f"--n-ref {n_ref}: must exceed --top-k {top_k} and be at most 2^32")
    bad = [v for v in n if not top_k < v <= MAX_N]
    if bad:
        raise UserError(f"--n {bad[0]}: must exceed --top-k {top_k} and be at most 2^32")
    if mc_rows < 0:
        raise UserError(f"--mc-rows {mc_rows}: expected 0 (annealed formulas) or a positive count of rows")
    if mc_rows > 0 and max(n) > MC_MAX_N:
        raise UserError(f"--n {max(n)} is too long for --mc-rows (Monte Carlo draws n logits per row); "
                        f"keep every --n <= {MC_MAX_N} or drop --mc-rows")
    if mc_rows * max(n_ref, *n) > MC_MAX_DRAWS:
        raise UserError(f"--mc-rows {mc_rows}: {mc_rows} rows x {max(n_ref, *n)} keys is more than 2^30 logits to "
                        f"draw per length (about 10 s each); use at most {MC_MAX_DRAWS // max(n_ref, *n)} rows")
    if seed < 0:
        raise UserError(f"--seed {seed}: expected an integer >= 0")
    m = _model(model, gap, sigma, top_k)
    lengths = np.asarray(sorted(set(n)), dtype=np.float64)
    corr = exact_alpha(m, lengths, n_ref)
    beta = tangent_slope(m)
    fixed = alpha_law("log-linear", lengths, n_ref=n_ref, slope=beta)
    n_far = max(float(lengths.max()), 2.0 * n_ref)
    try:
        beta_ls = least_squares_slope(m, n_ref, min(n_far, corr.horizon_n * 0.999))
    except ValueError:  # the horizon is at or below n_ref: nothing to fit
        beta_ls = None

    def masses(length: float, *alphas: float | None) -> list[float | None]:
        """Mass at ``length`` for each alpha (None stays None); Monte Carlo draws the rows once."""
        finite = [a for a in alphas if a is not None]
        if mc_rows > 0:
            values = iter(monte_carlo_mass(m, int(length), finite, rows=mc_rows, seed=seed)[0].tolist())
        else:
            values = iter(annealed_mass(m, length, np.asarray(finite)).tolist())
        return [None if a is None else next(values) for a in alphas]

    (mass_ref,) = masses(n_ref, 1.0)
    regimes = regime(m, lengths, np.where(corr.reachable, corr.alpha, fixed))
    rows = []
    for i, length in enumerate(lengths):
        a_exact = float(corr.alpha[i]) if corr.reachable[i] else None
        unscaled, exact, fixed_mass = masses(length, 1.0, a_exact, float(fixed[i]))
        rows.append({
            "n": int(length),
            "mass_unscaled": unscaled,
            "alpha_exact": a_exact,
            "mass_exact": exact,
            "alpha_fixed_slope": float(fixed[i]),
            "mass_fixed_slope": fixed_mass,
            "regime": str(regimes[i]),
            "note": None if a_exact is not None else (
                "past the correction horizon: no query scale restores the mass"
                if length > corr.horizon_n else "too short: even alpha = 0 leaves more than the reference mass"),
        })
    return {
        "model": model, "gap": gap, "sigma": sigma, "top_k": top_k, "n_ref": n_ref,
        "mass_model": "monte-carlo" if mc_rows > 0 else "annealed",
        "mass_ref": mass_ref,
        "beta_tangent": beta,
        "beta_least_squares": beta_ls,
        "least_squares_range": [n_ref, min(n_far, corr.horizon_n)],
        "horizon_n": None if math.isinf(corr.horizon_n) else corr.horizon_n,
        "rows": rows,
    }


def predict_from_stats(path, *, n: list[int] | None, n_ref: int | None = None, top_k: int | None = None,
                       tail: str = "power", bootstrap: int = 100, seed: int = 0) -> dict:
    """``sharpdraft predict --stats``: mass and exact alpha at each length from measured statistics.

    Per length: ``mass_unscaled`` (the distance model, ``sharpdraft_theory.distance``),
    ``mass_power_law`` (each head's constant-gamma law, gamma the closed-form estimator's (E2)
    over the calibrated lengths, from the mass of its longest rows), ``mass_iid`` (the same with
    gamma = 1), all means over every row of every head; ``alpha_exact`` restores the reference
    mass under the distance model, with a 95% bootstrap band over sequences.
    """
    from sharpdraft_theory.distance import TAIL_FORMS, fit_distance

    from .plot_cmd import MAX_BOOTSTRAP
    from .plots.files import load_stats

    if tail not in TAIL_FORMS:
        raise UserError(f"--tail {tail!r}: expected one of {', '.join(TAIL_FORMS)}")
    if not 0 <= bootstrap <= MAX_BOOTSTRAP:
        raise UserError(f"--bootstrap {bootstrap}: expected 0 (no band) to {MAX_BOOTSTRAP}")
    stats, _, n_ref, top_k = load_stats(path, n_ref=n_ref, top_k=top_k)
    if stats.distance is None:
        raise UserError(f"{path} holds no distance profile (written by an older version): calibrate again with --stats")
    longest = int(stats.n.max())
    lengths = sorted(set(n or [longest, 2 * longest, 4 * longest, 16 * longest]))
    bad = [v for v in lengths if not max(top_k + 1, n_ref) <= v <= MAX_N]
    if bad:
        raise UserError(f"--n {bad[0]}: must be at least --n-ref {n_ref} (and exceed --top-k {top_k}) and at most 2^32")
    try:
        fit = fit_distance(stats, n_ref=n_ref, top_k=top_k, tail=tail)
    except ValueError as err:
        raise UserError(f"cannot fit the distance model on {path}: {err}") from None
    model_mass = fit.mass(lengths)  # (N, A)
    one = int(np.argmin(np.abs(fit.alpha - 1.0)))
    corr = fit.exact_alpha(lengths, bootstrap=bootstrap, seed=seed)

    per_head = head_laws(fit, lengths)
    weights = per_head["rows"]

    def mean(values: np.ndarray) -> float:
        return float(np.average(np.where(weights > 0, values, 0.0), weights=weights))  # heads without rows: none

    rows = []
    for i, length in enumerate(lengths):
        rows.append({
            "n": int(length),
            "mass_unscaled": float(model_mass[i, one]),
            "mass_power_law": mean(per_head["power_law"][i]),
            "mass_iid": mean(per_head["iid"][i]),
            "alpha_exact": _finite(corr.alpha[i]),
            "alpha_low": _finite(corr.low[i]),
            "alpha_high": _finite(corr.high[i]),
            "extrapolated": bool(length > longest),
        })
    return {
        "stats": str(path), "n_ref": n_ref, "top_k": top_k, "tail": tail, "longest_calibrated_n": longest,
        "sequences": fit.sequences, "mass_ref": float(corr.mass_ref), "gamma_power_law": mean(per_head["gamma"]),
        "horizon_n": _finite(corr.horizon_n), "bootstrap": bootstrap, "rows": rows,
    }


def head_laws(fit, lengths) -> dict[str, np.ndarray]:
    """Per head, the laws ``predict --stats`` compares with the distance model, from the head's longest rows.

    Returns arrays over heads (``layer * heads + head``): ``rows`` (anchor rows: measured rows
    with ``n`` in the last half-octave), ``mass`` (their mean mass at ``a = 1``), ``n`` (their
    geometric mean length), ``gamma`` (the closed-form estimator's (E2) dilution exponent over
    the calibrated lengths; the global one where a head's is undefined), and (N, heads) arrays
    ``power_law`` (``dilution_mass`` with that gamma from ``(n, mass)``) and ``iid`` (gamma = 1).
    """
    from sharpdraft_theory.estimators import _Table, closed_form

    cells = fit.table.cells((_Table.LAYER, _Table.HEAD))
    gamma = np.full(fit.shape, np.nan)
    gamma[tuple(cells.groups.T)] = closed_form(cells, fit.n_ref).gamma
    gamma = np.where(np.isfinite(gamma), gamma, float(closed_form(fit.table.cells(()), fit.n_ref).gamma[0])).ravel()
    one = int(np.argmin(np.abs(fit.alpha - 1.0)))
    longest = int(fit.row_n.max())
    anchor = fit.row_n > longest / np.sqrt(2.0)
    heads = fit.shape[0] * fit.shape[1]
    rows = np.bincount(fit.row_head[anchor], minlength=heads).astype(np.float64)
    row_mass = expit(fit.log_top[anchor, one] - fit.log_rest[anchor, one])
    with np.errstate(invalid="ignore"):
        mass = np.bincount(fit.row_head[anchor], weights=row_mass, minlength=heads) / rows
        n_anchor = np.exp(np.bincount(fit.row_head[anchor], weights=np.log(fit.row_n[anchor]), minlength=heads) / rows)
    m0 = np.clip(mass, 1e-12, 1 - 1e-12)

    def law(g: np.ndarray) -> np.ndarray:  # (N, heads); NaN for heads without anchor rows
        return np.stack([dilution_mass(m0[h], lengths, n_anchor[h], fit.top_k, gamma=g[h]) if rows[h]
                         else np.full(len(lengths), np.nan) for h in range(heads)], axis=1)

    return {"rows": rows, "mass": mass, "n": n_anchor, "gamma": gamma, "power_law": law(gamma),
            "iid": law(np.ones(heads))}


def _finite(v) -> float | None:
    v = float(v)
    return v if math.isfinite(v) else None
