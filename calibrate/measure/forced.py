"""The teacher-forced many-arm pass: every arm of a drafter on the same rows, one target pass per sequence.

An *arm* is a deployment of the drafter: a scale spec (with its window, sinks or position fix) or
none, run on the main drafter, or another head of the same kind (``other``: a long-trained
reference). For each sequence, :func:`tally_sequence` runs the target once (the adapter's
``teacher_forced``: features and the target's next-token law) and then the drafter once per arm,
and reduces every row at once to per-bucket sums (:class:`Tally`): rows, greedy hits, expected
acceptance at temperature ``T`` (:mod:`calibrate.measure.metrics`) and top-k mass. Every summary
(:func:`summarize`, :func:`gain`) is built from the tallies, so one pass serves ``sharpdraft eval``,
its ``--slopes`` oracle and ``sharpdraft calibrate --select``, and a tally is what an interrupted
run keeps (``Tally.to_dict``).

Intervals resample sequences (rows of one sequence are not independent): paired differences
between arms use the same resamples (:func:`sharpdraft_theory.bootstrap.paired_bootstrap`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from sharpdraft_runtime import causal_mask
from sharpdraft_theory import ScaleSpec
from sharpdraft_theory.bootstrap import paired_bootstrap
from sharpdraft_theory.mass import topk_mass

__all__ = ["Arm", "MassMeter", "Tally", "tally_sequence", "summarize", "gain", "METRICS"]

#: What a tally sums per row, in the result's names: greedy agreement, expected acceptance at T.
METRICS = ("agreement", "expected_acceptance")


@dataclass(frozen=True)
class Arm:
    """One deployment measured on the shared rows."""

    name: str  # as reported (none, spec, window, slope 0.2, ...)
    spec: ScaleSpec | None = None  # applied in the drafter's attention (None: the drafter as it is)
    other: bool = False  # run on the other drafter (the reference head) instead of the main one


class MassMeter:
    """Top-k mass per bucket from attention calls (an ``AttentionTap``), as sums and counts.

    Up to ``rows_per_bucket`` query rows per bucket, evenly spaced, are measured (all heads of
    each), so the cost does not grow with n^2. The meter reads the query as it comes: show it the
    scaled query (``calibrate.taps.ScalingTap``) to measure a spec. Calls are eval's layout: one
    unpadded causal sequence whose query ``i`` sits at position ``k_len - q_len + i``, so it is
    bucketed by ``n = position + 1`` and sees the keys ``restrict``'s window and sinks keep
    (:func:`sharpdraft_runtime.causal_mask`'s rule; none: keys ``0 .. position``).
    """

    def __init__(self, edges: np.ndarray, top_k: int, rows_per_bucket: int = 96, restrict: ScaleSpec | None = None):
        self.edges, self.top_k, self.rows_per_bucket = edges, top_k, rows_per_bucket
        self.window, self.sinks = (None, None) if restrict is None else (restrict.window, restrict.sinks)
        self.sums = np.zeros(len(edges))  # (buckets,) summed row mass (mean over heads and layers' calls)
        self.counts = np.zeros(len(edges))  # (buckets,) rows measured

    def _rows(self, n: np.ndarray) -> np.ndarray:
        """Indices of the query rows to measure: evenly spaced within each bucket."""
        bucket = np.searchsorted(self.edges, n)
        chosen = []
        for b in range(len(self.edges)):
            idx = np.flatnonzero((bucket == b) & (n > self.top_k))
            if len(idx) > self.rows_per_bucket:
                idx = idx[np.linspace(0, len(idx) - 1, self.rows_per_bucket).round().astype(int)]
            chosen.append(idx)
        return np.concatenate(chosen)

    @torch.no_grad()
    def __call__(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float,
                 n_visible: torch.Tensor) -> None:
        q_len, k_len = query.shape[2], key.shape[2]
        n = np.arange(k_len - q_len, k_len) + 1  # (q,) keys the full drafter's row sees: its position + 1
        rows = self._rows(n)
        if len(rows) == 0:
            return
        groups = query.shape[1] // key.shape[1]
        k = key[0].float().repeat_interleave(groups, dim=0)  # (heads, k_len, D)
        for start in range(0, len(rows), 32):
            sel = rows[start:start + 32]
            q = query[0, :, torch.as_tensor(sel, device=query.device)].float()  # (heads, r, D)
            logits = (q @ k.transpose(-1, -2) * scaling).double().cpu().numpy()  # (heads, r, k_len)
            visible = causal_mask(k_len, sliding_window=self.window, sinks=self.sinks,
                                  positions=torch.as_tensor(n[sel] - 1)).numpy()  # (r, k_len)
            logits = np.where(visible[None], logits, -np.inf)
            mass = topk_mass(logits, self.top_k)  # (heads, r)
            np.add.at(self.sums, np.searchsorted(self.edges, n[sel]), mass.mean(axis=0))
            np.add.at(self.counts, np.searchsorted(self.edges, n[sel]), 1)

    def result(self) -> dict[int, float | None]:
        """Mean mass per bucket index (None where no row was measured)."""
        return {b: (self.sums[b] / self.counts[b] if self.counts[b] else None) for b in range(len(self.edges))}


@dataclass
class Tally:
    """Per-bucket sums of one sequence for every arm: all that a summary needs, and what a resumed run keeps."""

    rows: np.ndarray  # (buckets,) rows in each bucket (the same for every arm)
    sums: dict  # arm name -> {metric: (buckets,) sum over the bucket's rows}, metrics of METRICS
    mass: dict  # arm name -> (2, buckets): summed top-k mass of the measured rows, and their count

    def to_dict(self) -> dict:
        return {"rows": self.rows.tolist(), "sums": {a: {m: v.tolist() for m, v in s.items()} for a, s in self.sums.items()},
                "mass": {a: m.tolist() for a, m in self.mass.items()}}

    @classmethod
    def from_dict(cls, d, arms: list[str], buckets: int) -> "Tally":
        """The tally ``to_dict`` wrote, checked against the run's ``arms`` (names) and number of ``buckets``:
        a ``ValueError`` saying what is wrong for any other value (a damaged file of a resumed run)."""
        if not isinstance(d, dict) or set(d) != {"rows", "sums", "mass"}:
            raise ValueError("expected an object with rows, sums and mass")
        for name in ("sums", "mass"):
            if not isinstance(d[name], dict) or set(d[name]) != set(arms):
                raise ValueError(f"{name}: expected one entry per arm ({', '.join(arms)})")
        for arm, s in d["sums"].items():
            if not isinstance(s, dict) or set(s) != set(METRICS):
                raise ValueError(f"sums[{arm!r}]: expected {', '.join(METRICS)}")
        return cls(rows=_counts("rows", d["rows"], (buckets,)),
                   sums={a: {m: _counts(f"sums[{a!r}][{m!r}]", v, (buckets,)) for m, v in s.items()}
                         for a, s in d["sums"].items()},
                   mass={a: _counts(f"mass[{a!r}]", m, (2, buckets)) for a, m in d["mass"].items()})


def _counts(where: str, value, shape: tuple[int, ...]) -> np.ndarray:
    """``value`` as a float array of ``shape`` whose entries are finite and >= 0; else a ``ValueError``."""
    try:
        array = np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: expected numbers") from None
    if array.shape != shape or not (np.isfinite(array) & (array >= 0)).all():
        raise ValueError(f"{where}: expected finite numbers >= 0 of shape {shape}")
    return array


def _per_bucket(edges: np.ndarray, n: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Sums of ``values`` (rows,) per bucket of ``n`` (rows,): shape (buckets,); rows past the last edge dropped."""
    b = np.searchsorted(edges, n)
    keep = b < len(edges)
    return np.bincount(b[keep], weights=values[keep].astype(float), minlength=len(edges))


def tally_sequence(drafter, input_ids: torch.Tensor, arms: list[Arm], edges: np.ndarray, *, top_k: int,
                   temperature: float = 1.0, rows_per_bucket: int = 96, other=None) -> Tally:
    """Run every arm over one sequence ``input_ids`` (1, T) and reduce it to a :class:`Tally`.

    The main drafter's arms share one ``teacher_forced`` call (one target pass); the ``other``
    drafter's arms another. A row ``t`` of the adapters' layout is bucketed by ``n = t + 1``, the
    keys the full drafter sees there (a window lowers what the row really sees, not its bucket).
    """
    sums, mass = {}, {}
    rows = None
    for source, group in ((drafter, [a for a in arms if not a.other]), (other, [a for a in arms if a.other])):
        if not group:
            continue
        # a position fix remaps the logits a meter would read at the true positions: no mass for it
        meters = [None if a.spec is not None and a.spec.positions is not None
                  else MassMeter(edges, top_k, rows_per_bucket, a.spec) for a in group]
        forced = source.teacher_forced(input_ids, [(a.spec, m) for a, m in zip(group, meters)], temperature=temperature)
        n = np.arange(1, forced.drafted.shape[1] + 1)  # row t: the full drafter sees t + 1 keys (adapters' layout)
        rows = _per_bucket(edges, n, np.ones(len(n)))
        hits = (forced.drafted == forced.target_next).cpu().numpy()  # (arms, rows)
        accept = forced.accept.double().cpu().numpy()  # (arms, rows)
        for j, (arm, meter) in enumerate(zip(group, meters)):
            sums[arm.name] = {"agreement": _per_bucket(edges, n, hits[j]),
                              "expected_acceptance": _per_bucket(edges, n, accept[j])}
            mass[arm.name] = np.zeros((2, len(edges))) if meter is None else np.stack((meter.sums, meter.counts))
    return Tally(rows=rows, sums=sums, mass=mass)


def summarize(tallies: list[Tally], arms: list[Arm], edges: np.ndarray, *, base: str = "none") -> list[dict]:
    """Per bucket: ``{"n", "rows", "rows_per_sequence", arm: {mass, agreement, agreement_interval,
    expected_acceptance, expected_acceptance_interval, delta_vs_none: {metric: [mean, lo, hi]},
    per_sequence: {metric: [sum over the sequence's rows, ...]}}}``, intervals over sequences."""
    rows = np.stack([t.rows for t in tallies])  # (sequences, buckets)
    # per sequence, the rows and each arm's metric sums too: any two arms can be paired later
    # (scripts/eval_table.py --versus), with the same bootstrap over sequences
    buckets = [{"n": int(n), "rows": int(rows[:, b].sum()), "rows_per_sequence": rows[:, b].astype(int).tolist()}
               for b, n in enumerate(edges)]
    for arm in arms:
        mass = sum(t.mass[arm.name] for t in tallies)  # (2, buckets)
        for b, row in enumerate(buckets):
            cell = {"mass": _round(mass[0, b] / mass[1, b] if mass[1, b] else None)}
            for metric in METRICS:
                values = np.array([t.sums[arm.name][metric][b] for t in tallies])  # (sequences,)
                cell[metric] = _round(values.sum() / row["rows"] if row["rows"] else None)
                cell[f"{metric}_interval"] = _interval(paired_bootstrap(values, rows[:, b]))
                cell.setdefault("per_sequence", {})[metric] = [float(v) for v in values]
            if arm.name != base:
                cell["delta_vs_none"] = {metric: _triple(paired_bootstrap(
                    np.array([t.sums[arm.name][metric][b] - t.sums[base][metric][b] for t in tallies]), rows[:, b]))
                    for metric in METRICS}
            row[arm.name] = cell
    return buckets


def gain(tallies: list[Tally], arm: str, buckets: np.ndarray, *, metric: str = "agreement", base: str = "none",
         weights: np.ndarray | None = None) -> list[float] | None:
    """``[mean, lo, hi]``: ``arm``'s paired gain over ``base`` in ``metric``, averaged over the chosen
    ``buckets`` (indices; ``weights`` per chosen bucket, default equal), 95% bootstrap over sequences."""
    rows = np.stack([t.rows[buckets] for t in tallies])  # (sequences, chosen)
    diff = np.stack([t.sums[arm][metric][buckets] - t.sums[base][metric][buckets] for t in tallies])
    return _triple(paired_bootstrap(diff, rows, weights=weights))


def _triple(values: list[float] | None):
    return None if values is None else [_round(v) for v in values]


def _interval(values: list[float] | None):
    return None if values is None or values[1] is None else [_round(values[1]), _round(values[2])]


def _round(x: float | None, digits: int = 4):
    return None if x is None or not math.isfinite(x) else round(float(x), digits)
