"""Thin a calibration statistics file so it can live in the repository (< 5 MB).

    python notebooks/data/thin_stats.py FULL.npz OUT.npz [--n-ref 256] [--top-k 4]

Keeps the rows whose n lies on every other point of calibration's grid (4 per octave instead of
8) from ``--n-min`` on, the ``--k-max`` largest logits, and the alpha grid at 0.05 steps up to 2
and 0.2 steps beyond. The metadata is carried over; ``--n-ref`` and ``--top-k`` replace the
stored values (``--n-ref`` is needed for files that store none). Every kept number is the
calibration's own, so fits on the thinned file use a subset of the same rows.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields

import numpy as np

from calibrate.errors import UserError
from calibrate.plots import load_stats
from sharpdraft_theory.stats import RowStats


def thin(stats: RowStats, *, n_min: int, k_max: int) -> RowStats:
    steps = np.round(8 * np.log2(stats.n / 32.0)).astype(np.int64)  # position on the 8-per-octave grid
    keep = (stats.n >= n_min) & ((steps % 2 == 0) | (stats.n == stats.n.max()))
    grid = stats.alpha_grid
    step = np.where(grid <= 2.0 + 1e-9, 0.05, 0.2)
    on = np.isclose(np.round(grid / step) * step, grid) & (grid >= 0.5 - 1e-9)
    sub = stats.select(keep)
    values = {f.name: getattr(sub, f.name) for f in fields(RowStats)}
    values.update(alpha_grid=grid[on], lse=sub.lse[:, on], top=sub.top[:, :k_max], n=sub.n.astype(np.int32))
    return RowStats(**values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("full")
    parser.add_argument("out")
    parser.add_argument("--n-ref", type=int, help="default: stored in FULL")
    parser.add_argument("--top-k", type=int, help="default: stored in FULL, else 4")
    parser.add_argument("--n-min", type=int, default=64)
    parser.add_argument("--k-max", type=int, default=4)
    args = parser.parse_args()
    try:
        stats, meta, n_ref, top_k = load_stats(args.full, n_ref=args.n_ref, top_k=args.top_k)
    except UserError as err:
        parser.error(str(err))
    for key in ("grid", "alpha_grid", "k_max"):  # older files describe the full run; the thinned file says its own
        meta.pop(key, None)
    meta.update(n_ref=n_ref, top_k=top_k)
    small = thin(stats, n_min=args.n_min, k_max=max(args.k_max, top_k))
    small.save(args.out, **{k: json.dumps(v) for k, v in meta.items()})
    print(f"{stats.rows} -> {small.rows} rows, alpha grid {stats.alpha_grid.size} -> {small.alpha_grid.size}, "
          f"k_max {stats.k_max} -> {small.k_max}: {args.out}")


if __name__ == "__main__":
    main()
