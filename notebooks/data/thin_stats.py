"""Thin a calibration statistics file so it can live in the repository (< 5 MB).

    python notebooks/data/thin_stats.py FULL.npz OUT.npz [--n-ref 256] [--top-k 4] [--n-min 64] [--k-max 4]
                                        [--every 2] [--alphas fine|profile] [--no-profile] [--profile-float32]

Keeps the rows whose n lies on every ``--every``-th point of calibration's grid (8 per octave;
the default 2 keeps 4 per octave) from ``--n-min`` on, the ``--k-max`` largest logits, and the
alpha grid at 0.05 steps up to 2 and 0.2 steps beyond (``--alphas fine``) or only the distance
profile's alphas (``--alphas profile``); the profile's alphas are always kept, so the distance
model (``sharpdraft_theory.distance.fit_distance``) still reads the thinned file. The distance
profile is carried over whole unless ``--no-profile``; ``--profile-float32`` rounds its summed
weights to float32 (relative 6e-8: the distance model's mass moves by less than 1e-6), halving
its size. The metadata is carried over; ``--n-ref`` and ``--top-k`` replace the stored values
(``--n-ref`` is needed for files that store none). Every other kept number is the calibration's
own, so fits on the thinned file use a subset of the same rows.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields, replace

import numpy as np

from calibrate.errors import UserError
from calibrate.plots import load_stats
from sharpdraft_theory.stats import RowStats


def thin(stats: RowStats, *, n_min: int, k_max: int, every: int = 2, alphas: str = "fine",
         profile: bool = True, profile_float32: bool = False) -> RowStats:
    steps = np.round(8 * np.log2(stats.n / 32.0)).astype(np.int64)  # position on the 8-per-octave grid
    keep = (stats.n >= n_min) & ((steps % every == 0) | (stats.n == stats.n.max()))
    grid = stats.alpha_grid
    step = np.where(grid <= 2.0 + 1e-9, 0.05, 0.2)
    on = np.isclose(np.round(grid / step) * step, grid) & (grid >= 0.5 - 1e-9)
    if alphas == "profile":
        on = np.zeros(grid.size, dtype=bool)
    if stats.distance is not None:  # the distance model reads the rows at the profile's alphas
        on |= np.isclose(grid[:, None], stats.distance.alpha[None, :]).any(axis=1)
    sub = stats.select(keep)
    distance = sub.distance if profile else None
    if distance is not None and profile_float32:
        distance = replace(distance, weight=distance.weight.astype(np.float32))
    values = {f.name: getattr(sub, f.name) for f in fields(RowStats)}
    values.update(alpha_grid=grid[on], lse=sub.lse[:, on], top=sub.top[:, :k_max], n=sub.n.astype(np.int32),
                  distance=distance)
    return RowStats(**values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("full")
    parser.add_argument("out")
    parser.add_argument("--n-ref", type=int, help="default: stored in FULL")
    parser.add_argument("--top-k", type=int, help="default: stored in FULL, else 4")
    parser.add_argument("--n-min", type=int, default=64)
    parser.add_argument("--k-max", type=int, default=4)
    parser.add_argument("--every", type=int, default=2, choices=(1, 2), help="keep every (1) or every other (2) n")
    parser.add_argument("--alphas", default="fine", choices=("fine", "profile"))
    parser.add_argument("--no-profile", action="store_true", help="drop the distance profile")
    parser.add_argument("--profile-float32", action="store_true", help="round the profile's summed weights to float32")
    args = parser.parse_args()
    try:
        stats, meta, n_ref, top_k = load_stats(args.full, n_ref=args.n_ref, top_k=args.top_k)
    except UserError as err:
        parser.error(str(err))
    if args.alphas == "profile" and stats.distance is None:
        parser.error(f"--alphas profile: {args.full} holds no distance profile")
    for key in ("grid", "alpha_grid", "k_max"):  # older files describe the full run; the thinned file says its own
        meta.pop(key, None)
    meta.update(n_ref=n_ref, top_k=top_k)
    small = thin(stats, n_min=args.n_min, k_max=max(args.k_max, top_k), every=args.every, alphas=args.alphas,
                 profile=not args.no_profile, profile_float32=args.profile_float32)
    small.save(args.out, **{k: json.dumps(v) for k, v in meta.items()})
    print(f"{stats.rows} -> {small.rows} rows, alpha grid {stats.alpha_grid.size} -> {small.alpha_grid.size}, "
          f"k_max {stats.k_max} -> {small.k_max}"
          + (", distance profile kept" if small.distance is not None else "") + f": {args.out}")


if __name__ == "__main__":
    main()
