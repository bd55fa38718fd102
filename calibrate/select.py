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
length), with a 95% bootstrap interval over the calibration sequences. The candidate with the
largest mean gain *whose interval lies above 0* is written; when none qualifies, the identity
(``none``) is, and the summary says so. Equal bucket weights keep the longest bucket from being
drowned by the shorter ones, which hold fewer rows per sequence but are where dilution and drift
bite hardest. The choice is made on the calibration text; check it on held-out text with
``sharpdraft eval``.

The written spec is the candidate's own (a window is a spec; the runtime applies it), with the
drafter's identity and the calibration record, whose ``selection`` holds every candidate's
deployment, gains per bucket and overall (agreement and expected acceptance at T = 1), and the
rule, the choice and its reason.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from sharpdraft_theory import ScaleSpec
from sharpdraft_theory.positions import FIXES

from .errors import UserError
from .evaluate import LOOKUP_VARIANTS, describe_spec, variant_specs
from .measure import METRICS, Arm, gain, slope_arm, tally_sequence

__all__ = ["candidates", "select", "choose", "decision_line", "RULE"]

RULE = ("largest mean agreement gain over none, equal weights over the buckets past n_ref, among the candidates "
        "whose 95% interval over sequences lies above 0; none when no candidate qualifies")


def candidates(fitted: ScaleSpec, n_ref: int, longest: int) -> list[Arm]:
    """The candidate deployments for a fitted spec (module docstring); ``longest`` sets the group fix's G."""
    top_k = fitted.top_k
    variants = ("none", "spec", "qwen-logn", "sinks", *FIXES) + tuple(f"{f}+spec" for f in FIXES)
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


def select(drafter, sequences: list[list[int]], fitted: ScaleSpec, *, n_ref: int, max_length: int, longest: int,
           progress=None) -> tuple[ScaleSpec, dict]:
    """Measure the candidates on ``sequences`` and return the deployment to write (its spec, without the
    drafter and calibration record the caller attaches) and the ``selection`` record."""
    if not getattr(drafter, "teacher_forced", None):
        raise UserError(f"--select: the {drafter.kind} drafter has no teacher-forced pass to measure candidates "
                        "with; drop --select and check the spec with sharpdraft eval")
    edges = [n_ref]  # n_ref, then doublings up to the calibration length
    while edges[-1] < max_length:
        edges.append(min(2 * edges[-1], max_length))
    edges = np.asarray(edges)
    past = np.flatnonzero(edges > n_ref)
    if not len(past):
        raise UserError(f"--select: no length past n_ref={n_ref} below --max-length {max_length} to measure")
    arms = candidates(fitted, n_ref, longest)
    started = time.perf_counter()
    tallies = []
    for i, ids in enumerate(sequences):
        if progress:
            progress(f"selection: sequence {i + 1}/{len(sequences)}, {len(arms)} candidates")
        tallies.append(tally_sequence(drafter, torch.tensor([ids]), arms, edges, top_k=fitted.top_k))
    record = {"rule": RULE, "metric": "agreement", "weights": "equal", "sequences": len(sequences),
              "buckets": [int(edges[b]) for b in past], "seconds": round(time.perf_counter() - started, 1),
              "candidates": {}}
    for arm in arms:
        cell = {"deployment": describe_spec(arm.spec)}
        if arm.name != "none":
            cell["gain"] = {m: gain(tallies, arm.name, past, metric=m) for m in METRICS}
            cell["per_bucket"] = {str(int(edges[b])): {m: gain(tallies, arm.name, np.array([b]), metric=m)
                                                       for m in METRICS} for b in past}
        record["candidates"][arm.name] = cell
    chosen, record["reason"] = choose(record["candidates"])
    record["chosen"] = chosen
    spec = next(a.spec for a in arms if a.name == chosen)
    if spec is None:  # the identity, as a spec the runtime reads
        spec = ScaleSpec(law="constant", n_ref=None, slope=0.0, top_k=fitted.top_k)
    return spec, record


def choose(cells: dict) -> tuple[str, str]:
    """The rule (``RULE``) on the candidates' cells: the chosen name and the reason, in words."""
    qualified = {name: c["gain"]["agreement"] for name, c in cells.items()
                 if name != "none" and c["gain"]["agreement"] is not None and c["gain"]["agreement"][1] is not None
                 and c["gain"]["agreement"][1] > 0}
    if not qualified:
        return "none", "no candidate's agreement gain has an interval above 0: the drafter is left as it is"
    chosen = max(qualified, key=lambda name: qualified[name][0])
    return chosen, f"{chosen}: the largest agreement gain whose interval excludes 0"


def decision_line(record: dict) -> str:
    """One line: what to deploy and by how much it wins, against the fitted spec."""
    chosen, c = record["chosen"], record["candidates"]
    last = record["buckets"][-1]

    def at_last(name):
        t = c[name]["per_bucket"][str(last)]["agreement"]
        return "n/a" if t is None or t[1] is None else f"{t[0]:+.3f} [{t[1]:+.3f}, {t[2]:+.3f}]"

    head = (f"deploy {chosen}: {at_last(chosen)} agreement at {last}" if chosen != "none"
            else "deploy none (no candidate beats the drafter as it is)")
    return head + (f"; the fitted spec: {at_last('spec')}" if "spec" in c and chosen != "spec" else "")
