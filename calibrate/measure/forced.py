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

from dataclasses import dataclass, field

import numpy as np
import torch

from sharpdraft_runtime import causal_mask
from sharpdraft_theory import ScaleSpec
from sharpdraft_theory.bootstrap import paired_bootstrap
from sharpdraft_theory.mass import topk_mass

from ..numbers import rounded as _round, rounded_interval as _interval, rounded_triple as _triple

__all__ = ["Arm", "MassMeter", "Tally", "tally_sequence", "summarize", "gain", "METRICS", "DRAFTS", "SUBSETS",
           "TARGET"]

#: What a tally sums per row, in the result's names: greedy agreement, expected acceptance at T.
METRICS = ("agreement", "expected_acceptance")


#: Who drafts an arm's rows: the drafter, prompt lookup (``calibrate.lookup``), or lookup where it
#: finds a match and the drafter elsewhere.
DRAFTS = ("head", "lookup", "lookup+head")
#: Row subsets of a recall corpus (``calibrate.recall``), among the rows whose token is in the text:
#: the rows that predict a copied token, and the others. Metrics over them are ``copy_agreement``,
#: ``other_agreement``, ... ; the target's accuracy on the true text is ``copy_accuracy``, ...
SUBSETS = ("copy", "other")
TARGET = "target"  # the tally's pseudo-arm of the target's own accuracy on the true text


@dataclass(frozen=True)
class Arm:
    """One deployment measured on the shared rows."""

    name: str  # as reported (none, spec, window, slope 0.2, ...)
    spec: ScaleSpec | None = None  # applied in the drafter's attention (None: the drafter as it is)
    other: bool = False  # run on the other drafter (the reference head) instead of the main one
    drafts: str = "head"  # one of DRAFTS; lookup arms run the drafter as it is (spec None)


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
    sums: dict  # arm name -> {metric: (buckets,) sum over the bucket's rows}, metrics of METRICS; on a recall
    # corpus also "copy_<metric>" and "other_<metric>" over those rows, and the TARGET pseudo-arm's
    # {"copy_accuracy", "other_accuracy"}: its greedy token equals the true next token
    mass: dict  # arm name -> (2, buckets): summed top-k mass of the measured rows, and their count
    subsets: dict = field(default_factory=dict)  # subset of SUBSETS -> (buckets,) its rows (empty: not recall)

    def denominator(self, metric: str) -> np.ndarray:
        """(buckets,) the rows ``metric``'s sums run over: its subset's, or every row."""
        subset = metric.partition("_")[0]
        return self.subsets[subset] if subset in self.subsets else self.rows

    def to_dict(self) -> dict:
        return {"rows": self.rows.tolist(), "sums": {a: {m: v.tolist() for m, v in s.items()} for a, s in self.sums.items()},
                "mass": {a: m.tolist() for a, m in self.mass.items()},
                "subsets": {k: v.tolist() for k, v in self.subsets.items()}}

    @classmethod
    def from_dict(cls, d, arms: list[str], buckets: int) -> "Tally":
        """The tally ``to_dict`` wrote, checked against the run's ``arms`` (names) and number of ``buckets``:
        a ``ValueError`` saying what is wrong for any other value (a damaged file of a resumed run)."""
        if not isinstance(d, dict) or not {"rows", "sums", "mass"} <= set(d) <= {"rows", "sums", "mass", "subsets"}:
            raise ValueError("expected an object with rows, sums and mass (and subsets, on a recall corpus)")
        subsets = d.get("subsets", {})
        if not isinstance(subsets, dict) or (subsets and set(subsets) != set(SUBSETS)):
            raise ValueError(f"subsets: expected none or one entry per subset ({', '.join(SUBSETS)})")
        metrics = set(METRICS) | {f"{k}_{m}" for k in subsets for m in METRICS}
        expected = {"sums": set(arms) | ({TARGET} if subsets else set()), "mass": set(arms)}
        for name, names in expected.items():
            if not isinstance(d[name], dict) or set(d[name]) != names:
                raise ValueError(f"{name}: expected one entry per arm ({', '.join(sorted(names))})")
        for arm, s in d["sums"].items():
            wanted = {f"{k}_accuracy" for k in subsets} if arm == TARGET else metrics
            if not isinstance(s, dict) or set(s) != wanted:
                raise ValueError(f"sums[{arm!r}]: expected {', '.join(sorted(wanted))}")
        return cls(rows=_counts("rows", d["rows"], (buckets,)),
                   sums={a: {m: _counts(f"sums[{a!r}][{m!r}]", v, (buckets,)) for m, v in s.items()}
                         for a, s in d["sums"].items()},
                   mass={a: _counts(f"mass[{a!r}]", m, (2, buckets)) for a, m in d["mass"].items()},
                   subsets={k: _counts(f"subsets[{k!r}]", v, (buckets,)) for k, v in subsets.items()})


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
                   temperature: float = 1.0, rows_per_bucket: int | None = 96, other=None,
                   copied: np.ndarray | None = None, lookup=None, states=None) -> Tally:
    """Run every arm over one sequence ``input_ids`` (1, T) and reduce it to a :class:`Tally`.

    The main drafter's arms share one ``teacher_forced`` call (one target pass); the ``other``
    drafter's arms another. A row ``t`` of the adapters' layout is bucketed by ``n = t + 1``, the
    keys the full drafter sees there (a window lowers what the row really sees, not its bucket), and
    guesses token ``t + drafter.predicts`` of the text.

    Lookup arms (``Arm.drafts``) draft each row's token by prompt lookup over the tokens before it
    (``calibrate.lookup.next_token_drafts`` with the settings ``lookup``, default
    ``LookupSettings(eos_token_id=drafter.eos_token_id)``): greedy agreement when the draft is the
    target's greedy token, expected acceptance ``p_T(draft)`` (a point mass), 0 for both where lookup
    drafts nothing; ``lookup+head`` takes the drafter's row there. ``copied`` (T,) bool, a recall
    sequence's mask (``calibrate.recall``): the sums over the rows whose guessed token is copied and
    over the other rows of the text, and the target's own accuracy on both.

    ``rows_per_bucket``: rows per bucket whose top-k mass is measured (None: none, every mass 0).
    ``states``: the main drafter's target states of ``input_ids``, kept by its collection
    (``keeps_target_states``), so its target does not run again.
    """
    from ..lookup import LookupSettings, next_token_drafts

    sums, mass, subsets = {}, {}, {}
    rows = None
    text = input_ids[0].cpu().numpy()  # (T,)
    for source, group in ((drafter, [a for a in arms if not a.other]), (other, [a for a in arms if a.other])):
        if not group:
            continue
        runs = [a for a in group if a.drafts != "lookup"]  # the arms the drafter runs for
        # a position fix remaps the logits a meter would read at the true positions, and a lookup arm's rows
        # are not all the drafter's: no mass for them
        meters = [None if a.drafts != "head" or (a.spec is not None and a.spec.positions is not None)
                  or rows_per_bucket is None else MassMeter(edges, top_k, rows_per_bucket, a.spec) for a in runs]
        looks = any(a.drafts != "head" for a in group)
        if looks:
            settings = lookup or LookupSettings(eos_token_id=source.eos_token_id)
            looked = next_token_drafts(text.tolist(), settings)[source.predicts:]  # (rows,) row t: token t + predicts
        kept = {"states": states} if states is not None and source is drafter else {}
        forced = source.teacher_forced(input_ids, [(a.spec, m) for a, m in zip(runs, meters)], temperature=temperature,
                                       **({"proposals": torch.as_tensor(looked)} if looks else {}), **kept)
        R = forced.target_next.shape[0]
        n = np.arange(1, R + 1)  # row t: the full drafter sees t + 1 keys (adapters' layout)
        rows = _per_bucket(edges, n, np.ones(R))
        target_next = forced.target_next.cpu().numpy()  # (rows,)
        hits = (forced.drafted == forced.target_next).cpu().numpy()  # (runs, rows)
        accept = forced.accept.double().cpu().numpy()  # (runs, rows)
        if looks:
            found = looked >= 0  # (rows,) lookup drafts a token there
            look_hits, look_accept = found & (looked == target_next), forced.proposed_accept.double().cpu().numpy()
        masks = row_masks(copied, text, R, source.predicts)
        if masks:
            subsets = {k: _per_bucket(edges, n, m) for k, m in masks.items()}
            truth = np.r_[text, -1][np.minimum(np.arange(R) + source.predicts, len(text))]  # each row's true token
            sums[TARGET] = {f"{k}_accuracy": _per_bucket(edges, n, m & (target_next == truth))
                            for k, m in masks.items()}
        j = 0
        for arm in group:
            if arm.drafts == "lookup":
                h, a = look_hits, look_accept
            else:
                h, a = hits[j], accept[j]
                if arm.drafts == "lookup+head":
                    h, a = np.where(found, look_hits, h), np.where(found, look_accept, a)
                mass[arm.name] = np.zeros((2, len(edges))) if meters[j] is None else np.stack((meters[j].sums,
                                                                                               meters[j].counts))
                j += 1
            mass.setdefault(arm.name, np.zeros((2, len(edges))))
            sums[arm.name] = arm_sums(edges, n, h, a, masks)
    return Tally(rows=rows, sums=sums, mass=mass, subsets=subsets)


def row_masks(copied: np.ndarray | None, text: np.ndarray, rows: int, predicts: int) -> dict:
    """The recall subsets' rows (``SUBSETS`` -> (rows,) bool) of a sequence whose row ``t`` guesses token
    ``t + predicts``: ``copy`` where that token is copied, ``other`` where it is any other token of the
    text (the last rows guess past its end: neither). ``{}`` without a ``copied`` mask."""
    if copied is None:
        return {}
    guessed = np.minimum(np.arange(rows) + predicts, len(text))  # (rows,) the token each row guesses
    copy = np.r_[copied, False][guessed]
    return {"copy": copy, "other": (guessed < len(text)) & ~copy}


def arm_sums(edges: np.ndarray, n: np.ndarray, hits: np.ndarray, accept: np.ndarray, masks: dict) -> dict:
    """One arm's per-bucket sums (``Tally.sums[arm]``) from its rows' ``hits`` and ``accept`` (rows,), the
    rows seeing ``n`` keys: every row, and each subset of ``masks`` (:func:`row_masks`)."""
    values = {"agreement": hits, "expected_acceptance": accept}
    sums = {m: _per_bucket(edges, n, v) for m, v in values.items()}
    sums.update({f"{k}_{m}": _per_bucket(edges, n, v * mask) for k, mask in masks.items() for m, v in values.items()})
    return sums


def summarize(tallies: list[Tally], arms: list[Arm], edges: np.ndarray, *, base: str = "none") -> list[dict]:
    """Per bucket: ``{"n", "rows", "rows_per_sequence", arm: {mass, agreement, agreement_interval,
    expected_acceptance, expected_acceptance_interval, delta_vs_none: {metric: [mean, lo, hi]},
    per_sequence: {metric: [sum over the sequence's rows, ...]}}}``, intervals over sequences.

    On a recall corpus (tallies with ``subsets``) every arm also has ``copy_agreement``, ``other_agreement``,
    ``copy_expected_acceptance`` and ``other_expected_acceptance`` (means over those rows, with their
    intervals and deltas), the bucket ``copy_rows_per_sequence`` and ``other_rows_per_sequence``, and
    ``target``: ``{copy_accuracy, other_accuracy}``, the target's greedy token equal to the true next token."""
    rows = np.stack([t.rows for t in tallies])  # (sequences, buckets)
    # per sequence, the rows and each arm's metric sums too: any two arms can be paired later
    # (scripts/eval_table.py --versus), with the same bootstrap over sequences
    buckets = [{"n": int(n), "rows": int(rows[:, b].sum()), "rows_per_sequence": rows[:, b].astype(int).tolist()}
               for b, n in enumerate(edges)]
    for subset in tallies[0].subsets:
        counts = np.stack([t.subsets[subset] for t in tallies])  # (sequences, buckets)
        for b, row in enumerate(buckets):
            row[f"{subset}_rows_per_sequence"] = counts[:, b].astype(int).tolist()
    named = [(arm.name, arm.name != base) for arm in arms] + ([(TARGET, False)] if TARGET in tallies[0].sums else [])
    for name, paired in named:
        mass = sum(t.mass[name] for t in tallies) if name in tallies[0].mass else None  # (2, buckets)
        metrics = list(tallies[0].sums[name])
        for b, row in enumerate(buckets):
            cell = {} if mass is None else {"mass": _round(mass[0, b] / mass[1, b] if mass[1, b] else None)}
            for metric in metrics:
                values = np.array([t.sums[name][metric][b] for t in tallies])  # (sequences,)
                weights = np.array([t.denominator(metric)[b] for t in tallies])  # (sequences,) rows behind each sum
                cell[metric] = _round(values.sum() / weights.sum() if weights.sum() else None)
                cell[f"{metric}_interval"] = _interval(paired_bootstrap(values, weights))
                cell.setdefault("per_sequence", {})[metric] = [float(v) for v in values]
            if paired:
                cell["delta_vs_none"] = {metric: _triple(paired_bootstrap(
                    np.array([t.sums[name][metric][b] - t.sums[base][metric][b] for t in tallies]),
                    np.array([t.denominator(metric)[b] for t in tallies]))) for metric in metrics}
            row[name] = cell
    return buckets


def gain(tallies: list[Tally], arm: str, buckets: np.ndarray, *, metric: str = "agreement", base: str = "none",
         weights: np.ndarray | None = None) -> list[float] | None:
    """``[mean, lo, hi]``: ``arm``'s paired gain over ``base`` in ``metric``, averaged over the chosen
    ``buckets`` (indices; ``weights`` per chosen bucket, default equal), 95% bootstrap over sequences."""
    rows = np.stack([t.rows[buckets] for t in tallies])  # (sequences, chosen)
    diff = np.stack([t.sums[arm][metric][buckets] - t.sums[base][metric][buckets] for t in tallies])
    return _triple(paired_bootstrap(diff, rows, weights=weights))

