"""Long generations measured by output position: acceptance per bin, the fade, speedup, what the text does.

A speculative run's record is its list of accepted drafts per verification, ``accepted[i]`` in
``0 .. K`` (:class:`calibrate.speculative.SpeculativeResult`). The loop's prefill commits the first
output token, and verification ``i`` commits ``accepted[i] + 1`` tokens, so it starts at output
position ``1 + sum_{j < i} (accepted[j] + 1)`` (:func:`step_positions`) with the prompt's length more
keys of context. A verification belongs to the bin of the position where it starts (bins of
``bin_size`` output tokens: bin ``b`` holds positions ``b * bin_size .. (b + 1) * bin_size - 1``).

The figures, each over prompts (the independent unit; verifications of one prompt are not):

* acceptance length per bin: tokens committed per verifying forward, pooled over prompts
  (``sum tokens / sum forwards``), 95% bootstrap over prompts (:func:`acceptance_by_bin`);
* the fade: acceptance length in the last bin every prompt reaches over the first, the same ratio of
  pooled figures, with the same bootstrap (:func:`fade`); below 1 is a fade;
* speedup: target-only seconds over speculative seconds per prompt, and their geometric mean (the
  paper's headline) with a bootstrap interval (:func:`geometric_mean`);
* what the text does per bin (:func:`text_by_bin`): the share of tokens a 3-gram prompt lookup
  proposes a draft for, the share it drafts right, and distinct 4-grams over 4-grams; and whether
  the output ended in a loop (:func:`looped`). Together they tell a fade from a loop: a drafter
  whose acceptance rises while distinct 4-grams fall is copying a cycle.

The same bins on a fixed text, teacher-forced (``sharpdraft eval`` on a generated corpus, every arm on the
same tokens): row ``t`` of a sequence whose prompt holds ``P`` tokens is at output position ``t - P``
(rows inside the prompt are in no bin). One pass per sequence serves both reports: the rows are tallied
in finer buckets (:func:`output_edges`: every context-length edge, the prompt's end and every bin's end),
each of which lies in one context-length bucket and one output bin, and the tally is summed both ways
(:func:`regroup`). :func:`summarize_bins` gives each arm's agreement, expected acceptance and copy share
per bin, with paired intervals over sequences.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sharpdraft_theory.bootstrap import RESAMPLES

from sharpdraft_theory.bootstrap import paired_bootstrap

from ..lookup import LookupSettings, next_token_drafts
from ..numbers import rounded, rounded_interval, rounded_triple
from .forced import TARGET, Tally, summarize

__all__ = ["step_positions", "bin_tallies", "acceptance_by_bin", "prompts_by_bin", "fade", "geometric_mean",
           "text_by_bin", "looped", "output_edges", "regroup", "summarize_bins"]

LOOP_TAIL = 256  # tokens at the end of an output examined by looped()
LOOP_AGREEMENT = 0.95  # share of the tail equal to the token one period back that makes a loop


def step_positions(accepted: Sequence[int]) -> np.ndarray:
    """Output position (0-based) at which each verification starts: (steps,) int64.

    >>> step_positions([2, 0, 4]).tolist()
    [1, 4, 5]
    """
    committed = np.asarray(accepted, dtype=np.int64) + 1
    return 1 + np.concatenate([[0], np.cumsum(committed)[:-1]]) if len(committed) else np.zeros(0, np.int64)


def bin_tallies(accepted: Sequence[int], bin_size: int, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """``(forwards, tokens)`` per bin, each (bins,): verifications starting in the bin, tokens they committed.

    >>> f, t = bin_tallies([2, 0, 4, 1], bin_size=4, bins=2)
    >>> f.tolist(), t.tolist()  # starts at 1, 4, 5, 10: the last is past the two bins
    ([1, 2], [3, 6])
    """
    if bin_size < 1:
        raise ValueError(f"bin_size must be >= 1, got {bin_size}")
    a = np.asarray(accepted, dtype=np.int64)
    where = step_positions(a) // bin_size
    keep = where < bins
    forwards = np.bincount(where[keep], minlength=bins)[:bins]
    tokens = np.bincount(where[keep], weights=(a + 1)[keep], minlength=bins)[:bins]
    return forwards.astype(np.int64), tokens.astype(np.int64)


def _bootstrap(statistic, units: int, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float | None, float | None]:
    """95% percentile interval of ``statistic(picks)`` over resamples of ``units`` prompts (None with one)."""
    if units < 2 or resamples < 1:
        return None, None
    picks = np.random.default_rng(seed).integers(0, units, size=(resamples, units))
    with np.errstate(invalid="ignore", divide="ignore"):
        values = np.array([statistic(p) for p in picks])
    if not np.isfinite(values).any():
        return None, None
    lo, hi = np.nanpercentile(values, [2.5, 97.5])
    return float(lo), float(hi)


def acceptance_by_bin(runs: Sequence[Sequence[int]], bin_size: int, bins: int) -> list[list[float | None] | None]:
    """Per bin, ``[mean, lo, hi]`` of the pooled acceptance length over the ``runs`` (one accepted list a prompt)
    that reach the bin, resampling those prompts only (a prompt that ended before the bin says nothing about it;
    with one prompt there, ``lo`` and ``hi`` are None); None for a bin no verification reached.

    >>> acceptance_by_bin([[1, 1], [3, 0]], bin_size=100, bins=1)
    [[2.25, 2.0, 2.5]]
    """
    tallies = [bin_tallies(r, bin_size, bins) for r in runs]
    forwards = np.stack([f for f, _ in tallies])  # (prompts, bins)
    tokens = np.stack([t for _, t in tallies])
    out = []
    for b in range(bins):
        there = np.flatnonzero(forwards[:, b])
        if not len(there):
            out.append(None)
            continue
        f, t = forwards[there, b], tokens[there, b]
        lo, hi = _bootstrap(lambda p: t[p].sum() / f[p].sum(), len(there))
        out.append([float(t.sum() / f.sum()), lo, hi])
    return out


def prompts_by_bin(runs: Sequence[Sequence[int]], bin_size: int, bins: int) -> list[int]:
    """How many of ``runs`` have a verification starting in each bin (the prompts behind each bin's figure).

    >>> prompts_by_bin([[3] * 10, [0, 0]], bin_size=8, bins=3)
    [2, 1, 1]
    """
    return [int(n) for n in (np.stack([bin_tallies(r, bin_size, bins)[0] for r in runs]) > 0).sum(0)]


def fade(runs: Sequence[Sequence[int]], bin_size: int) -> list[float | None] | None:
    """``[mean, lo, hi]``: pooled acceptance length in the last bin every run reaches over that in the first.

    None when every run ends inside the first bin. Below 1: acceptance fell as the output grew.

    >>> fade([[4, 4, 0, 0], [4, 4, 0, 0]], bin_size=10)[0]
    0.2
    """
    reach = min(int(step_positions(r)[-1]) // bin_size if len(r) else 0 for r in runs)
    if reach < 1:
        return None
    tallies = [bin_tallies(r, bin_size, reach + 1) for r in runs]
    f = np.stack([x for x, _ in tallies]).astype(np.float64)
    t = np.stack([y for _, y in tallies]).astype(np.float64)

    def ratio(p):
        return (t[p, reach].sum() / f[p, reach].sum()) / (t[p, 0].sum() / f[p, 0].sum())

    lo, hi = _bootstrap(ratio, len(runs))
    return [float(ratio(np.arange(len(runs)))), lo, hi]


def geometric_mean(ratios: Sequence[float]) -> list[float | None]:
    """``[geometric mean, lo, hi]`` of per-prompt ratios (e.g. speedups), 95% bootstrap over prompts.

    >>> geometric_mean([2.0, 8.0])[0]
    4.0
    """
    values = np.asarray(ratios, dtype=np.float64)
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise ValueError(f"ratios must be positive and finite, got {list(ratios)}")
    logs = np.log(values)
    lo, hi = _bootstrap(lambda p: logs[p].mean(), len(logs))
    return [float(np.exp(logs.mean())), None if lo is None else float(np.exp(lo)),
            None if hi is None else float(np.exp(hi))]


def text_by_bin(tokens: Sequence[int], bin_size: int, bins: int, *, order: int = 3, distinct: int = 4) -> dict:
    """What an output does per bin of ``bin_size`` tokens: (bins,) arrays, nan where the output ends before.

    ``lookup_proposes``: share of tokens for which an ``order``-gram prompt lookup over the output so far
    has a draft; ``lookup_right``: share it drafts correctly; ``distinct_4grams``: distinct ``distinct``-grams
    starting in the bin over the ``distinct``-grams starting there.

    >>> d = text_by_bin([1, 2, 3] * 4, bin_size=6, bins=2)
    >>> d["lookup_right"].tolist(), d["distinct_4grams"].tolist()
    ([0.0, 1.0], [0.5, 1.0])
    """
    ids = np.asarray(tokens, dtype=np.int64)
    drafts = next_token_drafts(ids, LookupSettings(max_ngram=order, min_ngram=order))[:len(ids)]
    out = {k: np.full(bins, np.nan) for k in ("lookup_proposes", "lookup_right", "distinct_4grams")}
    grams = [tuple(ids[i:i + distinct]) for i in range(len(ids) - distinct + 1)]
    for b in range(bins):
        lo, hi = b * bin_size, min((b + 1) * bin_size, len(ids))
        if lo >= len(ids):
            break
        out["lookup_proposes"][b] = float((drafts[lo:hi] >= 0).mean())
        out["lookup_right"][b] = float((drafts[lo:hi] == ids[lo:hi]).mean())
        mine = grams[lo:min(hi, len(grams))]
        if mine:
            out["distinct_4grams"][b] = len(set(mine)) / len(mine)
    return out


def looped(tokens: Sequence[int], *, tail: int = LOOP_TAIL, agreement: float = LOOP_AGREEMENT) -> int | None:
    """The period of the loop an output ends in, or None: the shortest ``p <= tail // 2`` for which at
    least ``agreement`` of the last ``tail`` tokens equal the token ``p`` before them.

    >>> looped(list(range(300)) + [7, 8, 9] * 100)
    3
    >>> looped(list(range(600))) is None
    True
    """
    ids = np.asarray(tokens, dtype=np.int64)
    if len(ids) < tail + 1:
        return None
    end = ids[-tail:]
    for p in range(1, tail // 2 + 1):
        if (end == ids[len(ids) - tail - p:len(ids) - p]).mean() >= agreement:
            return p
    return None


def output_edges(edges: np.ndarray, prompt_length: int, bin_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(fine, context, bins)`` for one sequence whose prompt holds ``prompt_length`` tokens, its rows
    bucketed by ``n = t + 1`` up to ``edges[-1]`` (``calibrate.measure.forced``'s layout):

    ``fine`` (F,): upper edges of finer buckets, every edge of ``edges``, the prompt's end and each output
    bin's end below the last edge; ``context`` (F,): each fine bucket's index in ``edges``; ``bins`` (F,):
    its output bin (rows ``t`` with ``(t - prompt_length) // bin_size`` equal), -1 inside the prompt.

    >>> fine, context, bins = output_edges(np.array([8, 16]), prompt_length=3, bin_size=4)
    >>> fine.tolist(), context.tolist(), bins.tolist()
    ([3, 7, 8, 11, 15, 16], [0, 0, 0, 1, 1, 1], [-1, 0, 1, 1, 2, 3])
    """
    if bin_size < 1 or prompt_length < 0:
        raise ValueError(f"bin_size must be >= 1 and prompt_length >= 0, got {bin_size} and {prompt_length}")
    longest = int(edges[-1])
    ends = prompt_length + bin_size * np.arange(1, max(0, longest - prompt_length) // bin_size + 1)
    fine = np.unique(np.concatenate([np.asarray(edges, dtype=np.int64), ends[ends < longest],
                                     [prompt_length] if 0 < prompt_length < longest else []]).astype(np.int64))
    bins = np.where(fine > prompt_length, (fine - prompt_length - 1) // bin_size, -1)
    return fine, np.searchsorted(edges, fine), bins


def regroup(tally: Tally, to: np.ndarray, count: int) -> Tally:
    """``tally`` over fine buckets summed into ``count`` buckets: fine bucket ``i`` into ``to[i]`` (-1: left out).

    >>> t = Tally(rows=np.array([1., 2., 3.]), sums={"a": {"agreement": np.array([1., 1., 2.])}},
    ...           mass={"a": np.zeros((2, 3))})
    >>> r = regroup(t, np.array([-1, 0, 0]), 1)
    >>> r.rows.tolist(), r.sums["a"]["agreement"].tolist()
    ([5.0], [3.0])
    """
    onehot = np.zeros((len(to), count))  # (fine, count)
    kept = np.flatnonzero(to >= 0)
    onehot[kept, to[kept]] = 1.0
    return Tally(rows=tally.rows @ onehot,
                 sums={a: {m: v @ onehot for m, v in s.items()} for a, s in tally.sums.items()},
                 mass={a: m @ onehot for a, m in tally.mass.items()},
                 subsets={k: v @ onehot for k, v in tally.subsets.items()})


def summarize_bins(tallies: list[Tally], arms: list, bin_size: int) -> list[dict]:
    """Per output bin of ``bin_size`` tokens, from the sequences' tallies over bins (:func:`regroup`):
    :func:`calibrate.measure.forced.summarize`'s cells (every arm's agreement, expected acceptance, copy and
    other rows, each with its interval, paired deltas from none, per-sequence sums) under ``start`` and
    ``end`` instead of ``n``, and

    ``sequences``: those with rows in the bin; ``copy_rows_share`` ``[mean, lo, hi]``: share of the bin's rows
    that are copy rows; per arm (and the target) ``copy_share`` with ``copy_share_interval``: of the rows it
    gets right, the share that are copy rows. Intervals: 95% bootstrap over sequences.
    """
    rows = np.stack([t.rows for t in tallies])  # (sequences, bins)
    starts = bin_size * np.arange(rows.shape[1])
    out = summarize(tallies, arms, starts)
    for b, row in enumerate(out):
        copy = np.array([t.subsets["copy"][b] for t in tallies]) if tallies[0].subsets else None
        del row["n"]
        out[b] = row = {"start": int(starts[b]), "end": int(starts[b] + bin_size),
                        "sequences": int((rows[:, b] > 0).sum()),
                        "copy_rows_share": None if copy is None else rounded_triple(paired_bootstrap(copy, rows[:, b])),
                        **row}
        for name in [a.name for a in arms] + ([TARGET] if TARGET in tallies[0].sums else []):
            right = ("copy_accuracy", "other_accuracy") if name == TARGET else ("copy_agreement", "agreement")
            if right[0] not in tallies[0].sums[name]:
                continue
            hits = np.array([t.sums[name][right[0]][b] for t in tallies])  # (sequences,)
            total = np.array([t.sums[name][right[1]][b] for t in tallies])
            total = total + hits if name == TARGET else total  # the target: copy plus other rows right
            share = paired_bootstrap(hits, total)
            row[name]["copy_share"] = rounded(None if share is None else share[0])
            row[name]["copy_share_interval"] = rounded_interval(share)
    return out
