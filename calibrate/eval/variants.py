"""The variants ``sharpdraft eval`` compares: their names, checks and specs.

A variant is one way to deploy the drafter, measured on the same rows as the others: ``none`` (the
drafter as it is), ``spec`` (the spec under test), the baselines (``qwen-logn``, ``window``,
``sinks``), the distance fixes alone and with the spec (``clamp``, ``group``, ``pi``,
``clamp+spec`` ...), prompt lookup (``lookup``, ``lookup+head``), another head (``reference``), the
online arms (``calibrate.online``) and more specs on the same passes (``spec:NAME``,
``--extra-spec``). docs/eval.md describes each.
"""

from __future__ import annotations

import re

import numpy as np

from sharpdraft_theory import ScaleSpec, SpecError
from sharpdraft_theory.positions import FIXES, PositionFix, default_group, default_neighbour_window
from sharpdraft_theory.stats import DEFAULT_SINKS

from ..corpus import is_recall
from ..errors import UserError
from ..online import ONLINE_VARIANTS

__all__ = ["VARIANTS", "DEFAULT_VARIANTS", "POSITION_VARIANTS", "LOOKUP_VARIANTS", "EXTRA_PREFIX", "MAX_LENGTH",
           "DEFAULT_SINKS", "default_spec", "check_variants", "parse_extra_specs", "with_lookup",
           "position_fix", "variant_specs", "bucket_edges", "describe_spec", "at_top_k", "check_on_drafter"]

POSITION_VARIANTS = FIXES + tuple(f"{fix}+spec" for fix in FIXES)  # distance fixes, alone and with the spec
LOOKUP_VARIANTS = ("lookup", "lookup+head")  # prompt lookup, alone and with the drafter where it finds no match
VARIANTS = ("none", "spec", "qwen-logn", "window", "sinks", *POSITION_VARIANTS, *LOOKUP_VARIANTS, "reference",
            *ONLINE_VARIANTS)  # every variant eval knows
EXTRA_PREFIX = "spec:"  # the variant of an --extra-spec file: spec:NAME
EXTRA_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,23}")
DEFAULT_VARIANTS = ("none", "spec", "qwen-logn", "window", "sinks")  # reference joins when a reference head is given
MAX_LENGTH = 8192  # the longest bucket edge eval accepts


def default_spec(n_ref: int, top_k: int) -> ScaleSpec:
    """The spec used when none is given: log-linear at ``n_ref`` with the tangent slope of
    ``sharpdraft predict``'s default score model (Gaussian background, gap 6, sigma 1):
    ``1 / (gap - sigma^2) = 0.2``. Calibrate the drafter (``sharpdraft calibrate``) for a measured slope."""
    from sharpdraft_theory import Gaussian, tangent_slope

    slope = tangent_slope(Gaussian(gap=6.0, sigma=1.0, top_k=top_k))
    return ScaleSpec(law="log-linear", n_ref=n_ref, slope=round(float(slope), 6), top_k=top_k)


def check_variants(names: list[str], *, window: int | None, sinks: int, has_reference: bool,
                   neighbour_window: int | None = None, group: int | None = None, n_ref: int | None = None,
                   longest: int | None = None) -> tuple[str, ...]:
    """Validate ``--variants``, ``--window``, ``--sinks``, ``--neighbour-window`` and ``--group`` (before any
    model loads; ``n_ref`` and ``longest`` when known then); the variants in order."""
    if not names:
        raise UserError(f"--variants: give at least one of {', '.join(VARIANTS)}")
    for name in names:
        if name not in VARIANTS:
            raise UserError(f"--variants {','.join(names)}: unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    if len(set(names)) != len(names):
        raise UserError(f"--variants {','.join(names)}: a variant is named twice")
    if "reference" in names and not has_reference:
        raise UserError("--variants reference: pass --reference-drafter-path with the reference head")
    if window is not None and window < 1:
        raise UserError(f"--window {window}: expected a positive number of keys (default: the drafter's n_ref)")
    if sinks < 1:
        raise UserError(f"--sinks {sinks}: expected a positive number of sink keys (default {DEFAULT_SINKS})")
    if window is not None and sinks >= window:
        raise UserError(f"--sinks {sinks}: must be below --window {window} (the sinks variant keeps S sinks "
                        f"plus the last W - S keys)")
    _check_fix_options(neighbour_window, group, n_ref, longest)
    if window is not None and not {"window", "sinks"} & set(names):
        raise UserError(f"--window {window}: no variant uses it (only window and sinks do); add one to --variants, "
                        "or drop --window")
    if sinks != DEFAULT_SINKS and "sinks" not in names:
        raise UserError(f"--sinks {sinks}: no variant uses it (only sinks does); add it to --variants, or drop --sinks")
    for option, value, users in (("--neighbour-window", neighbour_window, ("clamp", "group")), ("--group", group,
                                                                                                 ("group",))):
        using = [f"{u}{plus}" for u in users for plus in ("", "+spec")]
        if value is not None and not set(using) & set(names):
            raise UserError(f"{option} {value}: no variant uses it (only {', '.join(using)} do); add one to --variants, "
                            f"or drop {option}")
    names = tuple(names)
    return names if "none" in names else ("none", *names)  # every delta is against none


def _check_fix_options(neighbour_window: int | None, group: int | None, n_ref: int | None, longest: int | None):
    """``--neighbour-window`` W in 1 .. n_ref - 1 (past it a far distance is itself untrained) and below the
    longest length; ``--group`` G in 2 .. the longest length (G = 1 groups nothing; a larger G holds every
    far key in one group)."""
    for option, value, least in (("--neighbour-window", neighbour_window, 1), ("--group", group, 2)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise UserError(f"{option} {value}: expected an integer >= {least}")
        if longest is not None and value > longest:
            raise UserError(f"{option} {value}: expected at most the longest of --lengths ({longest})")
    if neighbour_window is not None and n_ref is not None and neighbour_window >= n_ref:
        raise UserError(f"--neighbour-window {neighbour_window}: must be below the drafter's n_ref ({n_ref}); the "
                        f"far keys' distances start at W, and the drafter was trained on distances below n_ref")


def parse_extra_specs(values) -> dict[str, str]:
    """``--extra-spec NAME=FILE`` values (repeatable) as ``{"spec:NAME": FILE}``, in order; a ``UserError``
    for a value without ``=``, a bad or repeated NAME, or no FILE (the file is read by the caller)."""
    found: dict[str, str] = {}
    for value in values or ():
        name, sep, file = str(value).partition("=")
        if not sep:
            raise UserError(f"--extra-spec {value}: expected NAME=FILE, e.g. --extra-spec layer=spec-layer.json")
        if not EXTRA_NAME.fullmatch(name):
            raise UserError(f"--extra-spec {value}: the name {name!r} must be 1 to 24 lowercase letters, digits, "
                            "'-' or '_', starting with a letter or digit (the variant is reported as spec:NAME)")
        if not file.strip():
            raise UserError(f"--extra-spec {value}: give the spec file after '='")
        if EXTRA_PREFIX + name in found:
            raise UserError(f"--extra-spec {value}: the name {name} is given twice; give each spec its own name")
        found[EXTRA_PREFIX + name] = file
    return found


def with_lookup(variants, corpus: str) -> tuple[str, ...]:
    """``variants``, and ``lookup`` after them on a recall corpus: its agreement on the copied rows is
    part of that report."""
    variants = tuple(variants)
    return (*variants, "lookup") if is_recall(corpus) and "lookup" not in variants else variants


def position_fix(fix: str, n_ref: int, longest: int, *, neighbour_window: int | None = None,
                 group: int | None = None) -> PositionFix:
    """The ``fix`` variants' distance fix: W and G as given, else derived from ``n_ref`` and the longest
    length (``sharpdraft_theory.positions.default_neighbour_window``, ``default_group``)."""
    _check_fix_options(neighbour_window, group, n_ref, longest)
    if fix == "pi":
        return PositionFix("pi", n_ref=n_ref)
    window = default_neighbour_window(fix, n_ref) if neighbour_window is None else neighbour_window
    if fix == "clamp":
        return PositionFix("clamp", window=window)
    return PositionFix("group", window=window,
                       group=default_group(n_ref, longest, window) if group is None else group)


def variant_specs(spec: ScaleSpec, n_ref: int, variants=DEFAULT_VARIANTS, *, window: int | None = None,
                  sinks: int = DEFAULT_SINKS, neighbour_window: int | None = None, group: int | None = None,
                  longest: int | None = None) -> dict[str, ScaleSpec | None]:
    """The spec of each drafter variant (``reference`` is another drafter and has none here; the
    lookup variants run the drafter as it is).

    ``window`` W defaults to ``n_ref``; ``sinks`` keeps S sinks and the last W - S keys, so both
    restrictions leave the drafter unchanged at n <= W. The distance fixes take ``neighbour_window``
    and ``group`` (:func:`position_fix`, defaults from ``n_ref`` and ``longest``, the longest length);
    ``fix+spec`` is ``spec`` with that fix, its spec file the one to deploy.
    """
    window = n_ref if window is None else window
    if sinks >= window:
        raise UserError(f"--sinks {sinks}: must be below the window {window} (the drafter's n_ref by default)")

    def baseline(**restriction):
        return ScaleSpec(law="constant", n_ref=None, slope=0.0, top_k=spec.top_k, **restriction)

    made = {"none": None, "spec": spec, "qwen-logn": ScaleSpec(law="qwen-logn", n_ref=n_ref, slope=None,
                                                               top_k=spec.top_k),
            "window": baseline(window=window), "sinks": baseline(window=window - sinks, sinks=sinks),
            **{name: None for name in LOOKUP_VARIANTS}}
    for name in variants:
        if name in POSITION_VARIANTS:
            fix = position_fix(name.removesuffix("+spec"), n_ref, n_ref if longest is None else longest,
                               neighbour_window=neighbour_window, group=group)
            if name in FIXES:
                made[name] = baseline(positions=fix)
            elif spec.restricts():
                raise UserError(f"--variants {name}: the spec has a window, which drops the far keys a distance fix "
                                "remaps; give a spec without one")
            elif spec.positions is not None:
                raise UserError(f"--variants {name}: the spec already has a distance fix ({spec.positions.describe()}),"
                                f" which {name} would replace with {name.removesuffix('+spec')}; give a spec without "
                                "positions (the variant spec measures the one it has)")
            else:
                try:
                    made[name] = ScaleSpec.from_dict({**spec.to_dict(), "positions": fix.to_dict()})
                except SpecError as err:  # the fix's window, or pi's trained length, past the spec's own n_ref
                    mend = ("pass --n-ref at most the spec's n_ref" if fix.fix == "pi" else
                            "pass a --neighbour-window below the spec's n_ref")
                    raise UserError(f"--variants {name}: {err}; {mend} ({spec.n_ref}), or a spec calibrated at the "
                                    f"drafter's n_ref ({n_ref})") from None
    return {v: made[v] for v in variants if v != "reference"}


def bucket_edges(lengths: list[int]) -> np.ndarray:
    """Sorted, distinct bucket upper edges; a row with ``n`` visible keys falls in the first edge >= n."""
    edges = sorted(set(int(n) for n in lengths))
    if not edges or edges[0] < 2 or edges[-1] > MAX_LENGTH:
        raise UserError(f"--lengths {','.join(map(str, lengths))}: give context lengths from 2 to {MAX_LENGTH}, "
                        "e.g. 256,512,1024,2048")
    return np.asarray(edges)


def describe_spec(spec: ScaleSpec | None) -> dict | None:
    """A variant's deployment in the result: its spec's law, n_ref, (mean) slope, window and sinks."""
    if spec is None:
        return None
    return {"law": spec.law, "n_ref": spec.n_ref, "slope": _slope(spec), "window": spec.window, "sinks": spec.sinks,
            "positions": None if spec.positions is None else spec.positions.to_dict(),
            **({"granularity": spec.granularity} if spec.granularity != "global" else {}), **({"alpha": spec.table.alpha[-1]} if spec.table is not None and spec.granularity == "global" else {})}


def _slope(spec: ScaleSpec):
    slopes = spec.slopes()
    if slopes is None:
        return None
    return float(slopes) if slopes.ndim == 0 else float(np.mean(slopes))


def at_top_k(spec, k: int, label: str):
    """``spec`` with top-k ``k`` (the run's: every variant's mass is read at one k)."""
    if spec.top_k == k:
        return spec
    try:
        return ScaleSpec.from_dict({**spec.to_dict(), "top_k": k})
    except SpecError as err:
        raise UserError(f"--top-k {k}: does not fit {label} ({err})") from None


def check_on_drafter(spec, d, kind: str, n_ref: int, label: str) -> None:
    """A spec file against the loaded drafter: its layers and heads, a fix's window below n_ref and pi's at most n_ref."""
    try:
        spec.check_fits(d.info.num_layers, d.info.num_heads, what=f"the {kind} drafter")
    except SpecError as err:
        raise UserError(f"{label}: {err}") from None
    fix = spec.positions
    if fix is not None and fix.n_ref is not None and fix.n_ref > n_ref:
        raise UserError(f"{label}: positions.n_ref {fix.n_ref} (pi's trained length) must be at most the drafter's "
                        f"n_ref ({n_ref}): past it the fix leaves untrained positions as they are; write {n_ref} or "
                        "less, or pass --n-ref if the drafter's training length is larger")
    if fix is not None and fix.window is not None and fix.window >= n_ref:
        raise UserError(f"{label}: positions.window {fix.window} must be below the drafter's n_ref ({n_ref}), "
                        "as --neighbour-window: past n_ref a distance is itself untrained; write a smaller "
                        "window, or pass --n-ref if the drafter's training length is larger")
