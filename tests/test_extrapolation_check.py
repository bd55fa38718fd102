"""scripts/extrapolation_check.py (calibrate.extrapolation): measured mass per bucket past the fit, each law's
error, intervals over sequences."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from calibrate import extrapolation as xc
from sharpdraft_theory.stats import distance_edges, row_stats_from_logits

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "extrapolation_check.py"  # its command, run as one


def iid_rows(lengths, n_max, seqs, seed):
    """Rows of i.i.d. N(0, 1) logits (distance-free): the regime the i.i.d. law describes exactly."""
    rng = np.random.default_rng(seed)
    z, seq, head = [], [], []
    for s in range(seqs):
        for h in range(2):
            for n in lengths:
                for _ in range(3):
                    z.append(np.concatenate([rng.normal(size=n), np.full(n_max - n, -np.inf)]))
                    seq.append(s), head.append(h)
    return row_stats_from_logits(np.array(z), k_max=4, seq=seq, head=head, edges=distance_edges(n_max))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("xc")
    cal = iid_rows((48, 64, 90, 128, 181, 256), 256, 4, seed=1)
    meas = iid_rows((128, 256, 362, 512, 724, 1024), 1024, 5, seed=2)
    cal.save(folder / "cal.npz", n_ref=64, top_k=4)
    meas.save(folder / "meas.npz", n_ref=64, top_k=4)
    return folder / "cal.npz", folder / "meas.npz", meas


def test_buckets_hold_the_rows_past_the_fit_and_their_measured_mean(files):
    cal, meas_path, meas = files
    result = xc.check(cal, meas_path)
    assert result["longest_calibrated_n"] == 256 and result["measured_sequences"] == 5
    assert [b["n"] for b in result["buckets"]] == [362, 512, 724, 1024]
    mass = meas.mass(4)[:, meas.index_of_one]
    for b in result["buckets"]:
        direct = mass[meas.n == b["n"]].mean()  # each bucket holds one length here
        assert b["measured"][0] == pytest.approx(direct, abs=1e-12)
        assert b["rows"] == int((meas.n == b["n"]).sum()) and b["sequences"] == 5
        lo, hi = b["measured"][1:]
        assert lo < b["measured"][0] < hi  # an interval over 5 sequences, not a point


def test_each_error_is_the_measurement_less_a_fixed_prediction(files):
    cal, meas_path, _ = files
    for b in xc.check(cal, meas_path)["buckets"]:
        for law in ("distance", "power", "iid"):
            err, pred = b[law]["error"], b[law]["predicted"]  # predicted is rounded to 4 decimals
            # the prediction comes from the fit alone, so the error's interval is the measurement's, shifted
            assert err == pytest.approx([m - pred for m in b["measured"]], abs=6e-5)
        # a sanity bound, not an accuracy claim: on distance-free logits the distance model fitted at n <= 256
        # stays within 40% of the measured mass up to 4x that length (16% to 29% with these seeds)
        assert abs(b["distance"]["error"][0]) < 0.4 * b["measured"][0]


def test_a_measurement_no_longer_than_the_fit_is_refused_in_one_line(files, tmp_path):
    import subprocess
    import sys

    cal, _, _ = files
    with pytest.raises(SystemExit, match="no row longer than the calibration's longest \\(256\\)"):
        xc.check(cal, cal)
    run = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "missing.npz"), str(cal)],
                         capture_output=True, text=True)
    assert run.returncode == 1 and run.stderr.count("\n") == 1 and "missing.npz" in run.stderr
