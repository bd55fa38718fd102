"""``sharpdraft calibrate --select``: measure the candidate deployments and write the one that wins.

After the fit, the drafter runs teacher-forced over the calibration sequences once per candidate,
every candidate on the rows of one target pass per sequence (``calibrate.measure``, the engine
``sharpdraft eval`` runs). The candidates:

* ``none`` (the drafter as it is) and ``spec`` (the fitted law);
* ``slope s`` for s = half and twice the fitted (mean) slope: the slope grid around it;
* ``qwen-logn``;
* ``window W`` for W = n_ref / 2, n_ref, 2 n_ref (SGLang's draft window) and ``sinks`` (4 sinks
  plus the last n_ref - 4 keys);
* every distance fix the runtime applies (``clamp``, ``group``, ``pi``), alone and ``+spec``;
* ``lookup`` (prompt lookup, ``calibrate.lookup``) and ``lookup+head`` (lookup where it finds a
  match, the drafter as it is elsewhere): the training-free rival, measured on the same rows.

**The rule.** A candidate's score is its paired gain in top-1 agreement over ``none``, averaged
with equal weights over the length buckets past n_ref (edges n_ref * 2^j up to the calibration
length), with a 95% bootstrap interval over the calibration sequences. A candidate *qualifies*
when its interval lies above 0 and it does not lose agreement at ``n <= n_ref`` (its gain in that
bucket, ``within_n_ref``, does not have an interval below 0: a window narrower than n_ref changes
the drafter at every length, and a deployment must not buy long contexts with short ones); among them the *best by mean* has the largest mean gain. Every
qualifying candidate's paired difference from the best (its gain minus the best's, the same
bootstrap over sequences) is measured too, and among the candidates whose difference does not
exclude 0 (within noise of the best, the best included) the simplest deployment is written, in the
order ``SIMPLICITY``:

    none < scale (spec, slope s, qwen-logn) < window < sinks < lookup < distance fix (clamp, group, pi)
         < fix+scale (clamp+spec, ...) < lookup+head

(the larger mean breaks a tie within a kind). So more machinery is deployed only when it wins by
more than the noise. When no candidate qualifies, the identity (``none``) is written, and the
summary says so. Equal bucket weights keep the longest bucket from being drowned by the shorter
ones, which hold fewer rows per sequence but are where dilution and drift bite hardest. The choice
is made on the calibration text; check it on held-out text with ``sharpdraft eval``.

The written spec is the candidate's own (a window is a spec; the runtime applies it), with the
drafter's identity and the calibration record, whose ``selection`` holds every candidate's
deployment, gains per bucket and overall (agreement and expected acceptance at T = 1) and, for a
qualifying one, its difference from the best; and the rule, the simplicity order, the best by mean,
the choice and its reason.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from sharpdraft_theory import ScaleSpec
from sharpdraft_theory.positions import FIXES

from .errors import UserError
from .eval.variants import LOOKUP_VARIANTS, describe_spec, variant_specs
from .measure import METRICS, Arm, Tally, gain, slope_arm, tally_sequence

__all__ = ["SIMPLICITY", "kind_of", "candidates", "length_edges", "select", "judge", "choose", "deployed",
           "decision_line", "RULE"]

#: Deployments from simplest to most machinery: the tie-break among candidates within noise of the best.
SIMPLICITY = ("none", "scale", "window", "sinks", "lookup", "fix", "fix+scale", "lookup+head")

RULE = ("among the candidates whose agreement gain over none (equal weights over the buckets past n_ref) has a 95% "
        "interval over sequences above 0 and whose gain at n <= n_ref has no interval below 0, the simplest whose paired difference from the largest mean gain does not "
        f"exclude 0, simplest first: {' < '.join(SIMPLICITY)}; none when no candidate qualifies")


def kind_of(name: str) -> str:
    """A candidate's kind in ``SIMPLICITY``: ``spec``, ``slope 0.2`` and ``qwen-logn`` are ``scale``,
    ``window 128`` a ``window``, ``clamp`` a ``fix``, ``clamp+spec`` a ``fix+scale``."""
    if name in ("spec", "qwen-logn") or name.startswith("slope "):
        return "scale"
    if name.startswith("window "):
        return "window"
    if name in FIXES:
        return "fix"
    if name.endswith("+spec") and name.removesuffix("+spec") in FIXES:
        return "fix+scale"
    if name in SIMPLICITY:  # none, sinks, lookup, lookup+head
        return name
    raise ValueError(f"candidate {name!r}: no kind in the simplicity order {SIMPLICITY}")


def candidates(fitted: ScaleSpec, n_ref: int, longest: int) -> list[Arm]:
    """The candidate deployments for a fitted spec (module docstring); ``longest`` sets the group fix's G."""
    top_k = fitted.top_k
    variants = ("none", "spec", "qwen-logn", "sinks", *FIXES, *(f"{f}+spec" for f in FIXES))
    made = variant_specs(fitted, n_ref, [v for v in variants if not (v.endswith("+spec") and fitted.restricts())],
                         longest=longest)
    arms = [Arm(name, spec) for name, spec in made.items()]
    slopes = fitted.slopes()
    if fitted.law == "log-linear" and slopes is not None and float(np.mean(slopes)) > 0:
        slope = float(np.mean(slopes))
        arms[2:2] = [slope_arm(round(f * slope, 4), n_ref, top_k) for f in (0.5, 2.0)]
    for w in (n_ref // 2, n_ref, 2 * n_ref):
        if w > top_k:
            arms.append(Arm(f"window {w}", ScaleSpec(law="constant", n_ref=None, slope=0.0, top_k=top_k, window=w)))
    return arms + [Arm(name, None, drafts=name) for name in LOOKUP_VARIANTS]


def length_edges(n_ref: int, max_length: int) -> np.ndarray:
    """The selection's bucket edges: n_ref, then doublings up to the calibration length (the last one it).

    >>> length_edges(256, 1000).tolist()
    [256, 512, 1000]
    """
    edges = [n_ref]
    while edges[-1] < max_length:
        edges.append(min(2 * edges[-1], max_length))
    return np.asarray(edges)


def select(drafter, sequences: list[list[int]], fitted: ScaleSpec, *, n_ref: int, max_length: int, longest: int,
           progress=None, states: dict | None = None) -> tuple[ScaleSpec | None, dict]:
    """Measure the candidates on ``sequences`` and return the chosen deployment (its spec, None for the
    identity; ``deployed`` makes the file) and the ``selection`` record.

    Every candidate of a sequence reads one target pass and the drafter's layers up to its attention
    once (the adapter's ``teacher_forced``); ``states`` (sequence index -> the target states the
    collection kept, ``keeps_target_states``) spares that target pass too. No candidate's top-k mass is
    measured: the rule reads agreement and acceptance only."""
    if not getattr(drafter, "teacher_forced", None):
        raise UserError(f"--select: the {drafter.kind} drafter has no teacher-forced pass to measure candidates "
                        "with; drop --select and check the spec with sharpdraft eval")
    edges = length_edges(n_ref, max_length)
    if not (edges > n_ref).any():
        raise UserError(f"--select: no length past n_ref={n_ref} below --max-length {max_length} to measure")
    arms = candidates(fitted, n_ref, longest)
    started = time.perf_counter()
    tallies = []
    for i, ids in enumerate(sequences):
        if progress:
            progress(f"selection: sequence {i + 1}/{len(sequences)}, {len(arms)} candidates")
        tallies.append(tally_sequence(drafter, torch.tensor([ids]), arms, edges, top_k=fitted.top_k,
                                      rows_per_bucket=None, states=(states or {}).get(i)))
    record = judge(tallies, arms, edges, n_ref)
    record["seconds"] = round(time.perf_counter() - started, 1)
    return next(a.spec for a in arms if a.name == record["chosen"]), record


def judge(tallies: list[Tally], arms: list[Arm], edges: np.ndarray, n_ref: int) -> dict:
    """The ``selection`` record (all but its ``seconds``) from the sequences' tallies: every candidate's
    gains over none, each qualifying one's paired difference from the best by mean, and the choice."""
    past, within = np.flatnonzero(edges > n_ref), np.flatnonzero(edges <= n_ref)
    record = {"rule": RULE, "simplicity": list(SIMPLICITY), "metric": "agreement", "weights": "equal",
              "sequences": len(tallies), "buckets": [int(edges[b]) for b in past], "candidates": {}}
    cells = record["candidates"]
    for arm in arms:
        cells[arm.name] = {"deployment": describe_spec(arm.spec)}
        if arm.name != "none":
            cells[arm.name]["gain"] = {m: gain(tallies, arm.name, past, metric=m) for m in METRICS}
            cells[arm.name]["per_bucket"] = {str(int(edges[b])): {m: gain(tallies, arm.name, np.array([b]), metric=m)
                                                                  for m in METRICS} for b in past}
            if len(within):
                cells[arm.name]["within_n_ref"] = {m: gain(tallies, arm.name, within, metric=m) for m in METRICS}
    record["best"] = best = _best(cells)
    for name in _qualified(cells):  # the same bootstrap as the gains: resamples of the sequences, paired
        cells[name]["versus_best"] = gain(tallies, name, past, base=best)
    record["chosen"], record["reason"] = choose(cells)
    return record


def _gains_past(cells: dict) -> dict[str, float]:
    """The candidates whose agreement gain over none past n_ref has an interval above 0: name -> mean gain."""
    out = {}
    for name, c in cells.items():
        g = c.get("gain", {}).get("agreement")
        if name != "none" and g is not None and g[1] is not None and g[1] > 0:
            out[name] = g[0]
    return out


def _harms_short(cell: dict) -> bool:
    """Whether a candidate loses agreement at n <= n_ref: its ``within_n_ref`` gain has an interval below 0
    (a record without the field, written before the rule read it, harms nothing)."""
    w = (cell.get("within_n_ref") or {}).get("agreement")
    return w is not None and w[2] is not None and w[2] < 0


def _qualified(cells: dict) -> dict[str, float]:
    """The candidates that qualify (the rule): a gain past n_ref above 0, no loss at n <= n_ref; name -> mean gain."""
    return {name: g for name, g in _gains_past(cells).items() if not _harms_short(cells[name])}


def _best(cells: dict) -> str | None:
    """The qualifying candidate with the largest mean agreement gain (None: none qualifies)."""
    qualified = _qualified(cells)
    return max(qualified, key=qualified.get) if qualified else None


def choose(cells: dict) -> tuple[str, str]:
    """The rule (``RULE``) on the candidates' cells (``judge``'s): the chosen name and the reason, in words."""
    qualified, best = _qualified(cells), _best(cells)
    harming = [n for n in _gains_past(cells) if n not in qualified]
    excluded = (f"; {', '.join(harming)} gain{'s' if len(harming) == 1 else ''} past n_ref but lose"
                f"{'s' if len(harming) == 1 else ''} agreement at n <= n_ref, so "
                f"{'it does' if len(harming) == 1 else 'they do'} not qualify") if harming else ""
    if best is None:
        return "none", ("no candidate's agreement gain has an interval above 0 without a loss at n <= n_ref: the "
                        "drafter is left as it is" + excluded)

    def within_noise(name):
        d = cells[name]["versus_best"]
        return name == best or d is None or d[1] is None or d[1] <= 0 <= d[2]

    tied = [name for name in qualified if within_noise(name)]
    chosen = min(tied, key=lambda name: (SIMPLICITY.index(kind_of(name)), -qualified[name]))
    if chosen == best:
        rivals = [n for n in qualified if SIMPLICITY.index(kind_of(n)) < SIMPLICITY.index(kind_of(best))]
        return chosen, (f"{chosen}: the largest agreement gain whose interval excludes 0"
                        + (f"; every simpler qualifying candidate ({', '.join(rivals)}) is below it beyond the noise"
                           if rivals else "") + excluded)
    d = cells[chosen]["versus_best"]
    return chosen, (f"{chosen}: within noise of the best by mean, {best} (difference {_shown(d)}), and simpler "
                    f"({kind_of(chosen)} before {kind_of(best)} in the simplicity order)" + excluded)


def deployed(fitted: ScaleSpec, chosen: ScaleSpec | None, record: dict) -> ScaleSpec:
    """The spec ``--select`` writes: the ``chosen`` deployment (None: the identity, as a spec the runtime
    reads) with the fitted spec's drafter and calibration record, the selection ``record`` added to it."""
    if chosen is None:
        chosen = ScaleSpec(law="constant", n_ref=None, slope=0.0, top_k=fitted.top_k)
    d = fitted.to_dict()
    return ScaleSpec.from_dict({**chosen.to_dict(), "drafter": d["drafter"],
                                "calibration": {**d["calibration"], "selection": record}})


def _shown(t) -> str:
    return "n/a" if t is None or t[1] is None else f"{t[0]:+.3f} [{t[1]:+.3f}, {t[2]:+.3f}]"


def decision_line(record: dict) -> str:
    """One line: what to deploy and by how much it wins, against the best by mean (when the tie-break chose a
    simpler one) and the fitted spec."""
    chosen, best, c = record["chosen"], record["best"], record["candidates"]
    last = record["buckets"][-1]

    def at_last(name):
        return _shown(c[name]["per_bucket"][str(last)]["agreement"])

    if chosen == "none":
        return "deploy none (no candidate beats the drafter as it is)" + (
            f"; the fitted spec: {at_last('spec')} agreement at {last}" if "spec" in c else "")
    line = f"deploy {chosen}: {at_last(chosen)} agreement at {last}"
    if best not in (None, chosen):
        line += f"; the best by mean, {best}: {at_last(best)}, is within noise of it and more machinery"
    return line + (f"; the fitted spec: {at_last('spec')}" if "spec" in c and "spec" not in (chosen, best) else "")
