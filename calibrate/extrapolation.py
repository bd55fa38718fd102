"""The distance model's extrapolation on text it was not fitted on: predicted against measured mass, per law.

    python scripts/extrapolation_check.py CAL.npz MEAS.npz [--json]

``CAL.npz`` is a ``calibrate --stats`` file of short sequences (the fit: the distance model, each
head's constant-gamma power law and the i.i.d. law, exactly as ``sharpdraft predict --stats`` builds
them); ``MEAS.npz`` one of longer sequences of another text, measured with the same model and
``--top-k``. For every half-octave bucket of ``MEAS``'s rows past ``CAL``'s longest row, each law
predicts the mean top-k mass at the bucket's (geometric mean) length; the error is the measured
mean minus the prediction. Errors are means over the bucket's rows (every head), with a 95%
bootstrap interval over ``MEAS``'s sequences (the prediction is held fixed: the intervals carry the
measurement's spread, not the calibration's). ``|dist| - |power|`` is the paired difference of the
two laws' absolute errors per sequence: below 0 where the distance model is closer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from sharpdraft_theory.bootstrap import paired_bootstrap

from .errors import UserError
from .plots.files import load_stats
from .predict import predict_from_stats

LAWS = ("distance", "power", "iid")


def check(cal_path, meas_path, *, n_ref: int | None = None, top_k: int | None = None) -> dict:
    """Per bucket past the calibrated lengths: measured mass and each law's error, with intervals."""
    cal, _, n_ref, top_k = load_stats(cal_path, n_ref=n_ref, top_k=top_k)
    meas, _, _, _ = load_stats(meas_path, n_ref=n_ref, top_k=top_k)
    longest = int(cal.n.max())

    far = meas.n > longest
    if not far.any():
        raise SystemExit(f"{meas_path}: no row longer than the calibration's longest ({longest})")
    edges = longest * np.sqrt(2.0) ** np.arange(0, 2 * np.ceil(np.log2(meas.n.max() / longest)) + 2)
    bucket = np.searchsorted(edges, meas.n, side="left") - 1  # bucket b: edges[b] < n <= edges[b + 1]
    buckets = np.unique(bucket[far])
    lengths = [round(float(np.exp(np.log(meas.n[far & (bucket == b)]).mean()))) for b in buckets]  # geometric means
    # the three laws exactly as `sharpdraft predict --stats` gives them (no alpha band needed)
    laws = {r["n"]: r for r in predict_from_stats(cal_path, n=lengths, n_ref=n_ref, top_k=top_k, bootstrap=0)["rows"]}
    mass = meas.mass(top_k)[:, meas.index_of_one]
    seqs = np.unique(meas.seq)

    rows = []
    for b, n in zip(buckets, lengths):
        sel = far & (bucket == b)
        predicted = dict(zip(LAWS, (laws[n]["mass_unscaled"], laws[n]["mass_power_law"], laws[n]["mass_iid"])))
        per_seq = np.array([[mass[sel & (meas.seq == s)].sum(), (sel & (meas.seq == s)).sum()] for s in seqs])
        count = per_seq[:, 1]
        row = {"n": n, "rows": int(sel.sum()), "sequences": int((count > 0).sum()),
               "measured": paired_bootstrap(per_seq[:, 0], count)}
        errors = {}
        for law in LAWS:
            errors[law] = per_seq[:, 0] / np.maximum(count, 1) - predicted[law]  # per sequence: its mean minus the law
            row[law] = {"predicted": round(predicted[law], 4),
                        "error": paired_bootstrap(per_seq[:, 0] - predicted[law] * count, count)}
        row["abs_distance_minus_abs_power"] = paired_bootstrap(
            (np.abs(errors["distance"]) - np.abs(errors["power"])) * count, count)
        rows.append(row)
    return {"calibration": str(cal_path), "measurement": str(meas_path), "n_ref": n_ref, "top_k": top_k,
            "longest_calibrated_n": longest, "calibration_sequences": int(len(np.unique(cal.seq))),
            "measured_sequences": int(len(seqs)), "buckets": rows}


def _fmt(v) -> str:
    mean, lo, hi = v
    return f"{mean:+.3f}" + ("" if lo is None else f" [{lo:+.3f}, {hi:+.3f}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cal", type=Path)
    ap.add_argument("meas", type=Path)
    ap.add_argument("--n-ref", type=int)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        result = check(args.cal, args.meas, n_ref=args.n_ref, top_k=args.top_k)
    except UserError as err:
        raise SystemExit(f"error: {err}") from None
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"fit on {result['calibration_sequences']} sequences up to n = {result['longest_calibrated_n']}; "
          f"measured on {result['measured_sequences']}; top-{result['top_k']} mass; error = measured - predicted, "
          "95% interval over the measured sequences\n")
    print("| n | rows | measured | distance model | power law | i.i.d. law | abs err: distance - power |")
    print("|---:|---:|---|---|---|---|---|")
    for r in result["buckets"]:
        print(f"| {r['n']} | {r['rows']} | {r['measured'][0]:.3f} | "
              + " | ".join(f"{r[law]['predicted']:.3f} ({_fmt(r[law]['error'])})" for law in LAWS)
              + f" | {_fmt(r['abs_distance_minus_abs_power'])} |")


if __name__ == "__main__":
    main()
