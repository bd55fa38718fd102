"""Teacher-forced metrics of drafters that draft K tokens in one forward: DFlash blocks, PARD.

At anchors ``p`` of a held-out text the drafter proposes ``K`` tokens after ``x_p`` in one forward,
run by the very proposer the speculative loop runs (its ``draft_logits``: ``DFlashBlockProposer``,
``PardParallelProposer``, either with a copy pointer around it), over the true text ``x_0 .. x_p`` (and
the target's features of it).
Row ``k`` (``1 .. K``) guesses token ``p + k``; it is compared with the target along the true
text, the target's greedy token and law after position ``p + k - 1``. Per anchor and arm:

* ``agreement`` at position ``k``: row ``k``'s draft is the target's greedy token there;
* ``expected_acceptance`` at position ``k``: ``sum_x min(p_T(x), q_T(x))``, the chance speculative
  sampling accepts row ``k``'s draft were the rows before it accepted;
* ``accepted_length``: the drafts greedy verification accepts, the leading agreements (teacher-forced:
  the target's continuation of the true text stands in for its continuation of the drafts, which
  is the same wherever the drafts agree);
* ``expected_accepted_length``: ``sum_j prod_{i <= j} expected_acceptance_i``, an approximation: it
  takes the target's laws along the true text (not along the drafts) and the rows' acceptances as
  independent. ``tests/test_block_metrics.py`` checks it against a direct computation.

Anchors: ``per_bucket`` positions per bucket (rows ``p`` with ``n = p + 1`` in the bucket, and ``p + K``
inside the text), evenly spaced and deterministic, so a resumed run measures the same ones.
Intervals are over sequences, as everywhere in ``sharpdraft eval``.
"""

from __future__ import annotations

import numpy as np
import torch

from sharpdraft_theory.bootstrap import paired_bootstrap

from ..numbers import rounded as _round
from .forced import _counts

__all__ = ["BLOCK_NOTE", "block_anchors", "block_rows", "block_sums", "check_block_unit", "proposed",
           "summarize_blocks", "target_along"]

BLOCK_NOTE = ("teacher-forced: K drafts from one forward at anchors of the true text, against the target's greedy "
              "tokens and laws along the true text; expected_accepted_length = sum_j prod_{i<=j} acceptance_i "
              "treats the rows as independent (an approximation)")


def block_anchors(edges: np.ndarray, length: int, draft: int, per_bucket: int) -> tuple[np.ndarray, np.ndarray]:
    """Anchor positions (sorted) and each one's bucket: ``per_bucket`` per bucket, evenly spaced over its rows.

    >>> block_anchors(np.array([8, 16]), 16, 2, 3)
    (array([ 1,  4,  7,  8, 10, 13]), array([0, 0, 0, 1, 1, 1]))
    """
    anchors, buckets = [], []
    low = 1  # p >= 1: a context of at least one token
    for b, edge in enumerate(edges):
        high = min(int(edge) - 1, length - 1 - draft)  # n = p + 1 <= edge; the target's law at p + K - 1 exists
        if high >= low:
            picked = np.unique(np.linspace(low, high, min(per_bucket, high - low + 1)).round().astype(int))
            anchors += picked.tolist()
            buckets += [b] * len(picked)
        low = int(edge)
    return np.asarray(anchors, dtype=int), np.asarray(buckets, dtype=int)


@torch.no_grad()
def block_rows(source, input_ids: torch.Tensor, specs: dict, anchors: np.ndarray, draft: int,
               temperature: float = 1.0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per arm ``name -> spec`` of ``specs``: ``(hits, accept)``, each (anchors, draft), at ``anchors`` of
    ``input_ids`` (1, T) (module docstring). ``source`` is a drafter adapter whose ``proposer(spec)``
    is a ``BlockProposer`` (``draft_logits(k)``); the target runs once."""
    if not len(anchors):  # a text too short for one anchor: nothing to measure
        return {name: (np.zeros((0, draft), dtype=bool), np.zeros((0, draft))) for name in specs}
    features, law, greedy = target_along(source, input_ids, anchors, draft, temperature)
    out = {}
    for name, spec in specs.items():
        logits = proposed(source, spec, input_ids, features, anchors, draft)  # (A, K, vocab)
        hits = (logits.argmax(-1) == greedy).cpu().numpy()
        accept = law.acceptance(logits.flatten(0, 1)).view(len(anchors), draft).double().cpu().numpy()
        out[name] = (hits, accept)
    return out


@torch.no_grad()
def target_along(source, input_ids: torch.Tensor, anchors: np.ndarray, draft: int, temperature: float = 1.0):
    """The target once over ``input_ids`` (1, T): the drafter's features of it (None for a drafter that reads
    none), the target's law after each ``p + k - 1`` (a ``NextTokenLaw`` of ``anchors * draft`` rows) and its
    greedy tokens there (anchors, draft)."""
    from ..drafters.target import hidden_state_features
    from .metrics import NextTokenLaw

    target = source.target
    input_ids = input_ids.to(source.device)
    feature_ids = source.feature_ids
    layers = len(target.get_decoder().layers)
    states = hidden_state_features(target, input_ids, (*(feature_ids or ()), layers))
    width = target.config.hidden_size
    features = states[:, :, :-width] if feature_ids else None
    where = torch.as_tensor(anchors[:, None] + np.arange(draft), device=states.device)  # (A, K): law after p + k - 1
    law = NextTokenLaw(target.get_output_embeddings()(states[0, :, -width:][where.flatten()]), temperature)
    return features, law, law.greedy.view(len(anchors), draft)


@torch.no_grad()
def proposed(source, spec, input_ids: torch.Tensor, features, anchors: np.ndarray, draft: int) -> torch.Tensor:
    """The proposer's draft logits (anchors, draft, vocab) at each anchor ``p`` of the true text, ``x_p`` pending,
    as the speculative loop runs it (``source.proposer(spec)``, committing the text between anchors)."""
    input_ids = input_ids.to(source.device)
    text = input_ids[0].tolist()
    proposer = source.proposer(spec)
    try:
        logits = []
        first = int(anchors[0])
        proposer.start(input_ids[:, :first], None if features is None else features[:, :first], text[first])
        previous = first
        for p in anchors.tolist():
            if p != previous:  # the text up to x_p joins the context; x_p is pending
                proposer.commit(text[previous + 1:p + 1], None if features is None else features[:, previous:p])
                previous = p
            rows = proposer.draft_logits(draft)
            if rows.shape[0] != draft:
                raise ValueError(f"the drafter proposes {rows.shape[0]} tokens a forward, fewer than {draft}; "
                                 "lower --num-draft")
            logits.append(rows)
    finally:
        proposer.close()
    return torch.stack(logits)


def block_sums(rows: dict[str, tuple[np.ndarray, np.ndarray]], buckets: np.ndarray, count: int) -> dict:
    """One sequence's per-bucket sums: ``{"anchors": (buckets,), arm: {"agreement": (buckets, K),
    "expected_acceptance": (buckets, K), "accepted_length": (buckets,), "expected_accepted_length": (buckets,)}}``
    (JSON-ready lists)."""
    out = {"anchors": np.bincount(buckets, minlength=count).tolist()}
    for name, (hits, accept) in rows.items():
        leading = np.cumprod(hits, axis=1).sum(1)  # (A,) greedy: the matched prefix
        expected = np.cumprod(accept, axis=1).sum(1)  # (A,) sum_j prod_{i <= j} a_i
        per = lambda v: np.stack([v[buckets == b].sum(0) for b in range(count)])  # noqa: E731
        out[name] = {"agreement": per(hits.astype(float)).tolist(), "expected_acceptance": per(accept).tolist(),
                     "accepted_length": per(leading.astype(float)).tolist(),
                     "expected_accepted_length": per(expected).tolist()}
    return out


def check_block_unit(unit, names: list[str], buckets: int, draft: int) -> dict:
    """A saved sequence's :func:`block_sums` checked against the run: a ``ValueError`` otherwise."""
    if not isinstance(unit, dict) or set(unit) != {"anchors", *names}:
        raise ValueError(f"expected anchors and one entry per arm ({', '.join(names)})")
    shapes = {"agreement": (buckets, draft), "expected_acceptance": (buckets, draft), "accepted_length": (buckets,),
              "expected_accepted_length": (buckets,)}
    for where, value, shape in [("anchors", unit["anchors"], (buckets,))] + [
            (f"{n}.{m}", (unit[n] or {}).get(m) if isinstance(unit[n], dict) else None, s)
            for n in names for m, s in shapes.items()]:
        _counts(where, value, shape)
    return unit


def summarize_blocks(units: list[dict], names: list[str], edges: np.ndarray, draft: int,
                     per_bucket: int) -> dict:
    """The result's ``blocks`` entry: per bucket and arm, per-position means and the accepted lengths, with
    intervals over sequences and paired differences from ``none``."""
    anchors = np.array([u["anchors"] for u in units], dtype=float)  # (sequences, buckets)
    rows = []
    for b, n in enumerate(edges):
        row = {"n": int(n), "anchors": int(anchors[:, b].sum())}
        count = anchors[:, b]
        for name in names:
            cell = {}
            if count.sum() == 0:
                row[name] = None
                continue
            for metric in ("agreement", "expected_acceptance"):
                sums = np.array([u[name][metric][b] for u in units])  # (sequences, K)
                cell[f"{metric}_by_position"] = [round(float(v), 4) for v in sums.sum(0) / count.sum()]
            for metric in ("accepted_length", "expected_accepted_length"):
                sums = np.array([u[name][metric][b] for u in units])  # (sequences,)
                mean, lo, hi = paired_bootstrap(sums, count)
                cell[metric] = _round(mean)
                cell[f"{metric}_interval"] = None if lo is None else [_round(lo), _round(hi)]
                if name != "none":
                    base = np.array([u["none"][metric][b] for u in units])
                    cell.setdefault("delta_vs_none", {})[metric] = [_round(v) for v in
                                                                    paired_bootstrap(sums - base, count)]
            row[name] = cell
        rows.append(row)
    return {"draft_length": draft, "anchors_per_bucket": per_bucket, "note": BLOCK_NOTE, "buckets": rows}

