"""Statistics files for the figures: read one with its stored settings, describe it, write the standard set.

This module is the edge between files and figures: a setting missing from a file or out of its
range raises ``UserError`` naming the option that fixes it (``sharpdraft plot`` passes the
options through); the figure modules take plain arguments.

``sharpdraft calibrate --stats FILE`` stores beside the rows what they were collected and fitted
with, one JSON-encoded string per key (``calibrate.fit.record_meta``): ``n_ref``, ``top_k``,
``drafter`` (the kind), ``drafter_path``, ``target_path``, ``aux_layer_reading``,
``drafter_info``, ``corpus``, ``max_length``, ``sequences``, ``dtype``, ``granularity``,
``estimator``, ``alpha_max``, ``bootstrap`` and ``tool_version``; the alpha grid and ``k_max``
are the arrays' own. Files written before these keys were stored lack ``n_ref`` and need it given.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from sharpdraft_theory.distance import fit_distance
from sharpdraft_theory.drift import decompose, verdict
from sharpdraft_theory.estimators import fit_slopes
from sharpdraft_theory.stats import RowStats

from ..errors import UserError
from ..preflight import load_stats_file
from .budget import budget_curve, budget_figure
from .drift import drift_figure
from .measured import alpha_figure, measured_dilution_figure, slope_heatmap_figure
from .style import save_figure

__all__ = ["STANDARD_FIGURES", "BUDGET_FIGURE", "DRIFT_FIGURE", "load_stats", "describe_stats", "write_standard_figures"]

#: File names ``sharpdraft plot`` writes, in order.
STANDARD_FIGURES = ("dilution.png", "alpha.png", "slope_heatmap.png")

#: The attention budget's figure, written after them when the file holds the budget.
BUDGET_FIGURE = "budget.png"

#: Dilution or distance drift (``sharpdraft_theory.drift``), written last when the file holds a distance profile.
DRIFT_FIGURE = "drift.png"

DEFAULT_TOP_K = 4  # calibration's default --top-k, for files that do not store theirs
_DESCRIBED = ("drafter", "drafter_path", "corpus", "sequences", "max_length", "dtype", "granularity", "estimator",
              "tool_version")  # stored keys describe_stats shows, in order


def _meta_value(text: str):
    """Calibration stores run parameters JSON-encoded; older or hand-made files hold plain strings."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def load_stats(path: str | os.PathLike, *, n_ref: int | None = None, top_k: int | None = None):
    """``(stats, meta, n_ref, top_k)`` from a statistics file; settings not given come from its metadata.

    ``n_ref`` must be given or stored (``meta["n_ref"]``); ``top_k`` falls back to the stored value,
    then to 4 (calibration's default), and must lie in ``[1, stats.k_max]``. ``meta`` holds the
    stored values decoded. Raises ``UserError`` (one line) when the file cannot be read or a
    setting is missing or out of range.
    """
    path = Path(path)
    stats, raw = load_stats_file(path)
    meta = {key: _meta_value(text) for key, text in raw.items()}

    def setting(value, key, option, default=None):
        if value is not None:
            return int(value)
        stored = meta.get(key, default)
        if stored is None:
            raise UserError(f"{path.name} does not store {key}; pass {option}")
        try:
            return int(stored)
        except (TypeError, ValueError):
            raise UserError(f"{path.name} stores {key} = {stored!r}, not an integer; pass {option}") from None

    n_ref, top_k = setting(n_ref, "n_ref", "--n-ref"), setting(top_k, "top_k", "--top-k", DEFAULT_TOP_K)
    if not 1 <= top_k <= stats.k_max:
        raise UserError(f"--top-k {top_k} must be between 1 and {stats.k_max} (the k_max of {path.name})")
    return stats, meta, n_ref, top_k


def describe_stats(stats: RowStats, meta: dict, *, n_ref: int, top_k: int) -> str:
    """One paragraph: what the statistics file holds and the settings used to read it."""
    stored = ", ".join(f"{k} = {meta[k]}" for k in _DESCRIBED if k in meta)
    return (f"{stats.rows} rows: {np.unique(stats.layer).size} layers x {np.unique(stats.head).size} heads, "
            f"{np.unique(stats.seq).size} sequences, {np.unique(stats.n).size} sampled lengths "
            f"n = {int(stats.n.min())}..{int(stats.n.max())}; k_max = {stats.k_max}, alpha grid "
            f"{stats.alpha_grid.min():g}..{stats.alpha_grid.max():g} ({stats.alpha_grid.size} values)\n"
            f"run: {stored or 'no metadata'}\nread with n_ref = {n_ref}, top_k = {top_k}")


def _title(path: str | os.PathLike, meta: dict) -> str:
    """Figure title for a statistics file: its name and, when stored, the drafter and corpus."""
    parts = [str(meta[k]) for k in ("drafter", "corpus") if meta.get(k)]
    return Path(path).stem + (f" ({', '.join(parts)})" if parts else "")


def write_standard_figures(stats_path: str | os.PathLike, out: str | os.PathLike, *, n_ref: int | None = None,
                           top_k: int | None = None, bootstrap: int = 200, seed: int = 0,
                           trained_window: int | None = None) -> tuple[list[Path], list[str]]:
    """Write ``STANDARD_FIGURES`` (dilution curves, alpha versus n, slope heatmap), ``BUDGET_FIGURE``, ``DRIFT_FIGURE``.

    ``n_ref`` and ``top_k`` override the values stored in the file (``load_stats``);
    ``trained_window`` the seen window ``W`` of the drift verdict (default: stored, else ``n_ref``).
    Returns the paths written and lines for the user: the verdict, and a note for each figure
    skipped (a file without an attention budget or a distance profile, written before
    calibration collected them; a decomposition the rows cannot support).
    """
    stats, meta, n_ref, top_k = load_stats(stats_path, n_ref=n_ref, top_k=top_k)
    title = _title(stats_path, meta)
    try:
        fit = fit_slopes(stats, n_ref=n_ref, top_k=top_k, granularity="head", bootstrap=bootstrap, seed=seed)
    except ValueError as err:
        raise UserError(f"--n-ref {n_ref}: {err}") from None
    out = Path(out)
    figures = (measured_dilution_figure(stats, fit, n_ref=n_ref, top_k=top_k, title=title),
               alpha_figure(fit, n_ref=n_ref, title=title),
               slope_heatmap_figure(fit, title=title))
    paths = [save_figure(fig, out / name) for fig, name in zip(figures, STANDARD_FIGURES)]
    notes = []
    name = Path(stats_path).name
    if stats.budget is None:
        notes.append(f"{name} holds no attention budget (written before calibration collected it): {BUDGET_FIGURE} "
                     "skipped; `sharpdraft calibrate --stats` records it")
    else:
        curve = budget_curve(stats, bootstrap=bootstrap, seed=seed)
        paths.append(save_figure(budget_figure(curve, title=title), out / BUDGET_FIGURE))
    if stats.distance is None:
        notes.append(f"{name} holds no distance profile: {DRIFT_FIGURE} and the dilution/drift verdict skipped; "
                     "`sharpdraft calibrate --stats` records it")
        return paths, notes
    window = trained_window or meta.get("trained_window") or n_ref
    try:
        model = fit_distance(stats, n_ref=n_ref, top_k=top_k)
        parts = decompose(model, window=int(window), granularity=("global", "head"), bootstrap=bootstrap, seed=seed)
        found = verdict(model, window=int(window), bootstrap=bootstrap, seed=seed, parts=parts)
    except ValueError as err:
        notes.append(f"{DRIFT_FIGURE} and the dilution/drift verdict skipped: {err}")
        return paths, notes
    paths.append(save_figure(drift_figure(model, parts, found, title=title), out / DRIFT_FIGURE))
    lines = [f"past n_ref (seen distances d <= {found.window:,}): {found.line()}; {found.advice}"]
    if found.note:
        lines.append(f"verdict: {found.note}")
    return paths, lines + notes
