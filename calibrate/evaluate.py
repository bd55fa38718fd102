"""``sharpdraft eval``: does the spec recover the drafter at long context, and better than the alternatives?

For each context-length bucket and each variant it reports, on the same held-out rows:

``none``
    the drafter as it is (no scaling, full attention);
``spec``
    the scale spec under test;
``qwen-logn``
    Qwen's log-n query scaling at the drafter's ``n_ref`` (the usual scaling baseline);
``window``
    the drafter attends to its last W keys only (SGLang's ``--speculative-draft-window-size``;
    W = n_ref by default), a spec with law ``constant``, slope 0 and ``window`` W;
``sinks``
    the first S keys plus the last W - S (StreamingLLM; S = 4), so it too is the plain drafter at
    n <= W;
``clamp``, ``group``, ``pi``
    distance fixes (``sharpdraft_theory.positions``): the logits past the drafter's trained
    distances computed at remapped RoPE positions, a spec with law ``constant``, slope 0 and
    ``positions``: ``clamp`` (ReRoPE: distances >= W computed as W; W = n_ref - 1 by default, the
    identity up to n_ref keys), ``group`` (Self-Extend: the last W keys exact, farther ones at grouped
    positions; W = n_ref // 2 and the least G that keeps every grouped distance below n_ref up to the
    longest length, by default), ``pi`` (position interpolation: a row's positions divided by the
    least power of two that brings it within n_ref);
``clamp+spec``, ``group+spec``, ``pi+spec``
    the spec under test with that distance fix: alpha(n), n the visible keys, times the remapped logits;
``reference``
    another head of the same kind, unscaled (a long-trained head), when one is given;
``lookup``
    prompt lookup (``calibrate.lookup``), the training-free drafter of transformers'
    ``prompt_lookup_num_tokens`` and vLLM's ``ngram`` method: the longest of the context's last
    ``max_ngram`` .. ``min_ngram`` tokens found earlier drafts what followed it there. Teacher-forced,
    each row's draft is lookup's over the tokens before the row's token (no draft: a miss); its
    expected acceptance is ``p_T(draft)`` (a point mass); its mass is None (no attention);
``lookup+head``
    lookup where it finds a match, the drafter as it is (unscaled) elsewhere.
``online-full``, ``online-lora``, ``online-full+spec``, ``online-lora+spec``
    online adaptation (``calibrate.online``, EAGLE-3 heads, teacher-forced only): the drafter
    learns each sequence chunk by chunk, every chunk scored before it is learnt from.

Per bucket and variant:

``mass``
    mean top-k attention mass of the drafter's query rows in the bucket, measured on the queries
    the variant's run attends with (scaled by its spec, over the keys its window keeps), in every
    attention layer (``sharpdraft_theory.mass.topk_mass``, float64). None for the distance fixes:
    the meter reads the logits at the true positions, not the remapped ones.
``agreement``
    teacher-forced top-1 agreement: the drafter's greedy next token equals the target's greedy
    next token, over the same positions (the adapter's ``teacher_forced``; EAGLE-3: the head row
    at position ``t`` predicts token ``t + 2`` from the target feature at ``t`` and token ``t + 1``;
    ``hf`` / ``pard``: the drafter's and the target's next token at ``t``).
``expected_acceptance``
    teacher-forced, over the same rows: the probability that speculative sampling at temperature
    ``T`` accepts the drafter's token, ``sum_x min(p_T(x), q_T(x))`` for the target's and the
    drafter's next-token laws (``calibrate.measure.metrics``); greedy agreement is its ``T -> 0``
    limit.
``acceptance_length``, ``speedup`` (with ``speculative=True``)
    greedy speculative decoding with chains of ``num_draft`` after a prompt of ``n - new_tokens``
    tokens, one prompt per sequence: tokens committed per target forward that verifies drafts,
    and target-only decode time per token over speculative decode time per token (prefill
    excluded from both; ``calibrate.speculative``). The loop (``speculative.loop``) is the
    kind's: ``transformers-assisted`` for ``hf`` causal LMs (transformers'
    ``generate(assistant_model=...)``, the variant's spec enabled on the assistant),
    ``sharpdraft-chain`` for the others (``calibrate.speculative.speculative_generate``: EAGLE-3
    chains, DFlash blocks, PARD's parallel drafts, lookup).
    ``speculative.outputs_identical``: every run's output equals target-only greedy decoding by
    the same loop's target (``generate`` without an assistant; ``greedy_generate``), token for token.

    With ``sample=True`` the decoding is speculative sampling at ``temperature`` instead
    (``calibrate.speculative.Sampling``; transformers' ``do_sample=True`` in the assisted loop),
    and the baseline samples from the target alone. Every run from one prompt (the baseline and
    each variant) draws from its own copy of one random stream, seeded by ``seed`` and the prompt's
    tokens (:func:`prompt_seed`), so the variants are compared on the same draws where they agree
    (paired, like the greedy runs). A sampled output is one draw from the target's distribution,
    not a fixed sequence, so ``outputs_identical`` is None there, with ``outputs_identical_note``
    saying why (the law of the output is checked by tests/test_sampling.py).
``delta_vs_none``
    ``{"agreement", "expected_acceptance", "acceptance_length": [mean, lo, hi]}``: the paired difference
    from ``none`` over the same rows (agreement: pooled over the bucket's rows; acceptance: mean
    over prompts), with a 95% percentile bootstrap interval that resamples **sequences** (rows of
    one sequence are not independent), :func:`paired_bootstrap`.
``per_sequence`` and the bucket's ``rows_per_sequence``
    the sums behind the means, per sequence (agreement and expected acceptance: sums over the
    sequence's rows in the bucket; acceptance length: the prompt's value), so that any two
    variants can be paired afterwards with the same bootstrap (``scripts/eval_table.py --versus``).
``recovered``
    where the reference gains (its own ``delta_vs_none`` interval lies above 0): the variant's mean
    delta over the reference's, the share of the long-trained head's gain the variant recovers
    (else None: a loss has no share to recover).

``oracle`` (with ``slopes`` or ``alphas``)
    more arms on the same rows, teacher-forced only (``calibrate.measure.arms``: ``slope s`` and
    ``alpha c``), ranked by their agreement gain over ``none`` averaged with equal weights over the
    buckets past ``n_ref``, each with its paired interval: the best query scale the drafter admits.

On a **recall corpus** (``recall:SOURCE``, ``calibrate.corpus``: passages that recur verbatim at set
distances, the copied tokens marked; ``calibrate.recall``) every variant also reports ``copy_agreement``
and ``copy_expected_acceptance``, over the rows whose guessed token is a copied one (EAGLE-3's row
``t`` guesses token ``t + 2``, a causal LM's token ``t + 1``: the adapter's ``predicts``), and
``other_agreement`` / ``other_expected_acceptance`` over the other rows of the text, each with its
interval and paired delta; each bucket has ``target``: ``copy_accuracy`` and ``other_accuracy``, the
target's own greedy token equal to the true next token on those rows; and ``lookup`` is always run.
``recall`` in the result gives each sequence's repeat distance.
``costs``
    per arm: ``extra_bytes`` (what it holds beyond the drafter, from its tensors: 0 for every spec),
    ``peak_bytes`` (the peak memory of its pass, ``calibrate.online.PeakMemory``), and
    ``seconds_per_token`` (wall time of its pass over the rows it scored, target pass and updates
    included); ``pass``: ``shared`` for the arms of the one many-arm pass, ``own`` for an online arm,
    which runs alone.

Every teacher-forced arm shares one target pass per sequence (``calibrate.measure.forced``); each
finished sequence and speculative prompt is kept (``calibrate.measure.saved``), so an interrupted
run resumed gives the same result.

A bucket ``n`` holds the rows with ``n_prev < n <= n_edge`` where ``n`` is the number of keys
the full drafter sees at that row (a window lowers what the row really sees, not its bucket), so
at ``n <= n_ref`` every variant but ``reference`` is the plain drafter (alpha = 1, the window not
yet reached): the table must show no change in those buckets.

Every kind whose registry entry ``evaluates`` (``calibrate.drafters.KINDS``) runs the same way:
the drafter adapter provides the teacher-forced runs and the chain drafter (or, ``assisted``, the
assistant model).
"""

from __future__ import annotations

import dataclasses

import math
import re
import time
import zlib
from collections import defaultdict
from dataclasses import replace

import numpy as np
import torch

from sharpdraft_theory import ScaleSpec, SpecError
from sharpdraft_theory.positions import FIXES, PositionFix, default_group, default_neighbour_window
from sharpdraft_theory.bootstrap import RESAMPLES, paired_bootstrap
from sharpdraft_theory.stats import DEFAULT_SINKS

from .corpus import is_recall, pack, recall_corpus
from .drafters import drafter_kind
from .errors import UserError
from .lookup import LookupDrafter, LookupSettings, LookupThenHead
from .measure import METRICS, Arm, MassMeter, SavedUnits, Tally, gain, scale_grid, summarize, tally_sequence
from .measure.blocks import block_anchors, block_rows, block_sums, check_block_unit, summarize_blocks
from .measure.forced import row_masks
from .numbers import rounded as _round, rounded_interval as _interval, rounded_triple as _triple
from .online import (ONLINE_VARIANTS, OnlineOptions, PeakMemory, check_rank, extra_bytes,
                     online_arms, online_pass, tally_online)
from .speculative import (ASSISTED_LOOP, CHAIN_LOOP, GREEDY, Prefill, Sampling, SpeculativeResult, prefill,
                          speculative_generate, target_generate, transformers_generate)

__all__ = ["VARIANTS", "DEFAULT_VARIANTS", "POSITION_VARIANTS", "LOOKUP_VARIANTS", "with_lookup", "check_lookup_loop",
           "position_fix", "DEFAULT_SINKS", "default_spec",
           "variant_specs", "check_variants", "bucket_edges", "paired_bootstrap", "describe_spec", "evaluate",
           "prompt_seed", "parse_extra_specs", "EXTRA_PREFIX"]

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


def check_lookup_loop(kind: str, variants, speculative: bool) -> None:
    """Lookup decodes in the chain loop: a ``UserError`` for the lookup variants with ``--speculative``
    for a kind that decodes in transformers' assisted loop (``hf``)."""
    looked = [v for v in variants if v in LOOKUP_VARIANTS]
    if speculative and looked and drafter_kind(kind).assisted:
        raise UserError(f"--variants {','.join(looked)} with --speculative (lookup runs on every recall corpus): "
                        f"{kind} drafters decode in transformers' assisted loop, lookup in the chain loop; drop "
                        "--speculative or use a drafter of the chain loop (eagle3, dflash, pard)")


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
                except SpecError as err:  # the fix's neighbour window at or past the spec's own n_ref
                    raise UserError(f"--variants {name}: {err}; pass a --neighbour-window below the spec's n_ref "
                                    f"({spec.n_ref}), or a spec calibrated at the drafter's n_ref ({n_ref})") from None
    return {v: made[v] for v in variants if v != "reference"}


def bucket_edges(lengths: list[int]) -> np.ndarray:
    """Sorted, distinct bucket upper edges; a row with ``n`` visible keys falls in the first edge >= n."""
    edges = sorted(set(int(n) for n in lengths))
    if not edges or edges[0] < 2 or edges[-1] > MAX_LENGTH:
        raise UserError(f"--lengths {','.join(map(str, lengths))}: give context lengths from 2 to {MAX_LENGTH}, "
                        "e.g. 256,512,1024,2048")
    return np.asarray(edges)


# ----------------------------------------------------------------------------------------------
# The evaluation
# ----------------------------------------------------------------------------------------------

def evaluate(drafter, *, spec: ScaleSpec, lengths: list[int], corpus: str = "pydoc:heldout",
             sequences: int | None = None, skip: int = 0, rows_per_bucket: int = 96, speculative: bool = False,
             new_tokens: int = 32, num_draft: int | None = None, variants=DEFAULT_VARIANTS, window: int | None = None,
             sinks: int = DEFAULT_SINKS, reference=None, progress=None, n_ref: int | None = None,
             temperature: float = 1.0, slopes=(), alphas=(), saved: SavedUnits | None = None,
             neighbour_window: int | None = None, group: int | None = None,
             sample: bool = False, seed: int = 0, lookup: LookupSettings | None = None,
             online: OnlineOptions | None = None, extra_specs: dict[str, ScaleSpec] | None = None) -> dict:
    """Run the evaluation; returns the JSON-ready result (see the module docstring).

    Parameters
    ----------
    drafter : a ``calibrate.drafters`` adapter of a kind that ``evaluates`` (its ``target`` is the target)
    spec : ScaleSpec
        The spec under test (variant ``spec``).
    lengths : list of int
        Bucket upper edges; the longest is the packed sequence length.
    corpus : str
        Held-out text (``calibrate.corpus`` source); default the pydoc held-out split.
    sequences : int, optional
        At most this many sequences of ``max(lengths)`` tokens (None: every one the corpus holds).
    skip : int
        Sequences to pass over first (e.g. those of ``pydoc:train`` a demo head was trained on).
    variants : sequence of str
        Names from :data:`VARIANTS` (``none`` is always run: the deltas are against it).
    window, sinks : int
        The ``window`` variant's W (default ``n_ref``) and the ``sinks`` variant's S (window W - S).
    reference : drafter adapter, optional
        Another head of the same kind, run unscaled as the variant ``reference``.
    n_ref : int, optional
        The drafter's training length (default ``drafter.default_n_ref``): where qwen-logn starts and
        the window's default W.
    temperature : float
        ``T`` of the expected acceptance ``sum_x min(p_T, q_T)`` (``calibrate.measure.metrics``) and,
        with ``sample``, of speculative sampling.
    slopes, alphas : sequence of float
        The oracle's grid (``calibrate.measure.arms``): more arms on the same rows, teacher-forced only.
    saved : SavedUnits, optional
        Where finished sequences and prompts are kept and, resuming, read back.
    neighbour_window, group : int, optional
        W and G of the distance fixes (default: from ``n_ref`` and the longest length, :func:`position_fix`).
    sample, seed
        With ``speculative``: speculative sampling at ``temperature`` instead of greedy decoding,
        random streams seeded by ``seed`` and each prompt (:func:`prompt_seed`).
    lookup : LookupSettings, optional
        The lookup variants' n-gram range (default transformers': 2 down to 1); its end-of-sequence
        token is the drafter's, whatever is given.
    online : OnlineOptions, optional
        How the online variants learn (default ``OnlineOptions()``; ``calibrate.online``).
    extra_specs : dict, optional
        More specs measured as variants on the same passes, ``{"spec:NAME": spec}`` (``--extra-spec``),
        each at ``spec``'s top-k: a per-layer or per-head spec paired with the global one.
    """
    kind = drafter_kind(drafter.kind, evaluates=True)
    num_draft = draft_length(drafter, num_draft)
    block = drafter.block_size if kind.blocks else None
    if block is not None and num_draft > block - 1:
        raise UserError(f"--num-draft {num_draft}: a block of {block} drafts at most {block - 1} tokens a forward; "
                        f"give {block - 1} or fewer (or leave it out)")
    if kind.parallel and num_draft > max(lengths) - 2:
        raise UserError(f"--num-draft {num_draft}: one forward would draft past the sequences of {max(lengths)} tokens; "
                        f"give at most {max(lengths) - 2}")
    edges = bucket_edges(lengths)
    recall = is_recall(corpus)
    variants = with_lookup(variants, corpus)
    check_lookup_loop(drafter.kind, variants, speculative)
    if speculative and drafter.kind == "pard":
        drafter.pard_token  # noqa: B018 (read now: a PARD drafter without its mask token is refused before any pass)
    lookup = replace(lookup or LookupSettings(), eos_token_id=drafter.eos_token_id)
    n_ref = drafter.default_n_ref if n_ref is None else int(n_ref)
    saved = saved or SavedUnits(None, {}, resume=False)
    variants = check_variants(list(variants), window=window, sinks=sinks, has_reference=reference is not None,
                              neighbour_window=neighbour_window, group=group, n_ref=n_ref, longest=int(edges[-1]))
    if reference is not None and reference.kind != drafter.kind:
        raise UserError(f"--reference-drafter-path: the reference is a {reference.kind} drafter, "
                        f"expected {drafter.kind} like the drafter")
    learning = online_arms(variants, spec)
    if learning and not kind.online:
        raise UserError(f"--variants {learning[0].name}: online adaptation is for EAGLE-3 heads only for now, "
                        f"not {drafter.kind}")
    if learning and speculative:
        raise UserError(f"--variants {learning[0].name} with --speculative: online arms run teacher-forced only")
    specs = variant_specs(spec, n_ref, [v for v in variants if v not in ONLINE_VARIANTS], window=window, sinks=sinks,
                          neighbour_window=neighbour_window, group=group, longest=int(edges[-1]))
    specs.update(_extra_specs(extra_specs, spec.top_k))
    grid = scale_grid(list(slopes), list(alphas), n_ref, spec.top_k)
    arms = ([Arm(v, s, drafts=v if v in LOOKUP_VARIANTS else "head") for v, s in specs.items()] + grid
            + ([Arm("reference", None, other=True)] if reference is not None else []))
    shared = list(arms)  # the arms of the one many-arm pass
    arms += [Arm(a.name, a.spec) for a in learning]
    limit = None if sequences is None else skip + sequences
    if recall:
        recalled = recall_corpus(corpus, drafter.tokenize, drafter.eos_token_id, int(edges[-1]), limit)[skip:]
        texts, copied = [m.ids for m in recalled], [m.copied for m in recalled]
    else:
        texts = list(pack(corpus, drafter.tokenize, drafter.eos_token_id, int(edges[-1]), limit))[skip:]
        copied = [None] * len(texts)
    if not texts:
        raise UserError(f"--skip {skip}: {corpus} holds no more than {skip} sequences of {edges[-1]} tokens; "
                        "lower --skip or the largest length")
    if any(a.method == "online-lora" for a in learning):
        check_rank(drafter.head, (online or OnlineOptions()).rank)  # before any pass: the head's widths are known
    tallies, costs = [], []
    learners = {}  # online arm -> its learner, kept across sequences with online.carry
    for i, text in enumerate(texts):
        kept = saved.get(f"forced-{i:05d}", lambda d: _forced_unit(d, [a.name for a in arms], len(edges)))
        if kept is None:
            if progress:
                progress(f"sequence {i + 1}/{len(texts)}: teacher-forced, {len(shared)} arms"
                         + (f" + {len(learning)} online" if learning else ""))
            began = time.perf_counter()
            with PeakMemory(drafter.device) as peak:
                tally = tally_sequence(drafter, torch.tensor([text]), shared, edges, top_k=spec.top_k,
                                       temperature=temperature, rows_per_bucket=rows_per_bucket, other=reference,
                                       copied=copied[i], lookup=lookup)
            cost = {a.name: _cost("shared", time.perf_counter() - began, len(text) - 1, peak,
                                  None if a.other else extra_bytes(None)) for a in shared}
            for arm in learning:
                if progress:
                    progress(f"sequence {i + 1}/{len(texts)}: {arm.name}")
                cost[arm.name], learners[arm.name] = _online(drafter, text, arm, online or OnlineOptions(), edges,
                                                             tally, spec.top_k, temperature, rows_per_bucket,
                                                             learners.get(arm.name), copied[i])
            saved.put(f"forced-{i:05d}", {**tally.to_dict(), "costs": cost})
        else:
            tally, cost = kept
        tallies.append(tally)
        costs.append(cost)
    buckets = summarize(tallies, arms, edges)
    blocks = None
    if kind.parallel:
        blocks = _blocks(drafter, texts, {v: s for v, s in specs.items() if v not in LOOKUP_VARIANTS}, edges,
                         num_draft, temperature, saved, progress)
    names = [a.name for a in arms if a not in grid]
    loop = ASSISTED_LOOP if kind.assisted else CHAIN_LOOP
    all_identical = None
    if speculative:
        def rule(prompt):  # a fresh rule per run: every run from one prompt draws the same stream
            return Sampling(temperature, prompt_seed(seed, prompt)) if sample else GREEDY

        all_identical, drafters = _speculative(drafter, reference, loop, texts, edges, specs, buckets, new_tokens,
                                               num_draft, progress, saved, rule, lookup)
    if reference is not None:
        _recovered(buckets, names)
    return {
        "drafter": {"kind": drafter.kind, "path": drafter.info.path, "n_ref": n_ref, **_pointer(drafter)},
        "reference": None if reference is None else {"kind": reference.kind, "path": reference.info.path,
                                                     **_pointer(reference)},
        "corpus": corpus, "skip": skip, "sequences": len(texts), "sequence_length": int(edges[-1]),
        "top_k": spec.top_k, "temperature": temperature,
        "bootstrap": {"unit": "sequence", "resamples": RESAMPLES, "level": 0.95},
        "variants": {a.name: describe_spec(a.spec) for a in arms},  # an online arm: the spec it runs under
        "lookup": lookup.to_dict() if any(a.drafts != "head" for a in arms) else None,
        "recall": {"distances": [m.distance for m in recalled]} if recall else None,
        "speculative": None if not speculative else {**_speculative_record(loop, new_tokens, num_draft, all_identical,
                                                                           sample, temperature, seed, drafter),
                                                     "drafters": drafters},
        "oracle": _oracle(tallies, grid, edges, n_ref) if grid else None,
        "blocks": blocks,
        "online": None if not learning else (online or OnlineOptions()).to_dict(),
        "costs": _costs(costs, [a.name for a in arms if a not in grid]),
        "buckets": buckets,
    }


def _extra_specs(extra: dict | None, top_k: int) -> dict[str, ScaleSpec]:
    """The ``--extra-spec`` variants, checked: named ``spec:NAME``, at the run's top-k."""
    extra = dict(extra or {})
    for name, spec in extra.items():
        if not (name.startswith(EXTRA_PREFIX) and EXTRA_NAME.fullmatch(name.removeprefix(EXTRA_PREFIX))):
            raise ValueError(f"extra spec variant {name!r}: expected {EXTRA_PREFIX}NAME")
        if spec.top_k != top_k:
            raise UserError(f"--extra-spec {name.removeprefix(EXTRA_PREFIX)}: its top_k {spec.top_k} is not the run's "
                            f"{top_k}; every variant's mass is read at one top-k")
    return extra


BLOCK_ANCHORS = 16  # anchors per bucket and sequence of the parallel drafters' per-position metrics


def _blocks(drafter, texts, specs: dict, edges, draft: int, temperature: float, saved: SavedUnits, progress) -> dict:
    """The ``blocks`` entry for a drafter that drafts ``draft`` tokens in one forward (``calibrate.measure.blocks``):
    per-position agreement and acceptance, and the accepted lengths, per bucket, every arm of ``specs``."""
    names = list(specs)
    units = []
    for i, text in enumerate(texts):
        unit = saved.get(f"blocks-{i:05d}", lambda d: check_block_unit(d, names, len(edges), draft))
        if unit is None:
            if progress:
                progress(f"sequence {i + 1}/{len(texts)}: {draft} drafts per forward at {BLOCK_ANCHORS} anchors a bucket")
            anchors, buckets = block_anchors(edges, len(text), draft, BLOCK_ANCHORS)
            rows = block_rows(drafter, torch.tensor([text]), specs, anchors, draft, temperature)
            unit = block_sums(rows, buckets, len(edges))
            saved.put(f"blocks-{i:05d}", unit)
        units.append(unit)
    return summarize_blocks(units, names, edges, draft, BLOCK_ANCHORS)


def _online(drafter, text, arm, options: OnlineOptions, edges, tally: Tally, top_k, temperature, rows_per_bucket,
            learner, copied: np.ndarray | None = None):
    """Run one online arm over one sequence into ``tally`` (with ``copied``, a recall sequence's mask, its
    copy and other rows too); its cost, and the learner to carry (or None)."""
    meter = MassMeter(edges, top_k, rows_per_bucket, arm.spec)
    with PeakMemory(drafter.device) as peak:
        out, learner, seconds = online_pass(drafter, torch.tensor([text]), arm, options, temperature=temperature,
                                            meter=meter, learner=learner if options.carry else None)
    masks = row_masks(copied, np.asarray(text), out.drafted.shape[1], drafter.predicts)
    tally.sums[arm.name], tally.mass[arm.name] = tally_online(out, edges, meter, masks)
    return _cost("own", seconds, out.drafted.shape[1], peak, extra_bytes(learner)), learner


def _forced_unit(unit, names: list[str], buckets: int) -> tuple[Tally, dict]:
    """A saved sequence (its tally and each arm's cost) checked against the run's arm ``names`` and number
    of ``buckets``: a ``ValueError`` saying what is wrong otherwise."""
    if not isinstance(unit, dict) or not isinstance(unit.get("costs"), dict) or set(unit["costs"]) != set(names):
        raise ValueError(f"costs: expected one entry per arm ({', '.join(names)})")
    for name, c in unit["costs"].items():
        if not isinstance(c, dict) or set(c) != set(COST_FIELDS):
            raise ValueError(f"costs[{name!r}]: expected {', '.join(COST_FIELDS)}")
    return Tally.from_dict({k: v for k, v in unit.items() if k != "costs"}, names, buckets), unit["costs"]


COST_FIELDS = ("pass", "seconds", "tokens", "peak_bytes", "peak_method", "extra_bytes")  # one arm's cost (_cost)


def _cost(kind: str, seconds: float, tokens: int, peak: PeakMemory, extra: dict | None) -> dict:
    """One arm's cost on one sequence (what a resumed run keeps)."""
    return dict(zip(COST_FIELDS, (kind, seconds, tokens, peak.peak, peak.method, extra)))


def _costs(per_sequence: list[dict], names: list[str]) -> dict:
    """Per arm over the sequences: ``extra_bytes`` and ``peak_bytes`` (the largest), ``seconds_per_token``
    (all seconds over all tokens), the ``pass`` it ran in and how the peak was read."""
    out = {}
    for name in names:
        cells = [c[name] for c in per_sequence if name in c]
        if not cells:
            continue
        peaks = [c["peak_bytes"] for c in cells if c["peak_bytes"] is not None]
        extras = [c["extra_bytes"] for c in cells if c["extra_bytes"] is not None]
        tokens = sum(c["tokens"] for c in cells)
        out[name] = {"pass": cells[0]["pass"],
                     "extra_bytes": max(extras, key=lambda e: e["total"]) if extras else None,
                     "peak_bytes": max(peaks) if peaks else None, "peak_method": cells[0]["peak_method"],
                     "seconds_per_token": _round(sum(c["seconds"] for c in cells) / tokens, 7) if tokens else None}
    return out


def describe_spec(spec: ScaleSpec | None) -> dict | None:
    """A variant's deployment in the result: its spec's law, n_ref, (mean) slope, window and sinks."""
    if spec is None:
        return None
    return {"law": spec.law, "n_ref": spec.n_ref, "slope": _slope(spec), "window": spec.window, "sinks": spec.sinks,
            "positions": None if spec.positions is None else spec.positions.to_dict(),
            **({"granularity": spec.granularity} if spec.granularity != "global" else {}), **({"alpha": spec.table.alpha[-1]} if spec.table is not None and spec.granularity == "global" else {})}


def _oracle(tallies, grid, edges: np.ndarray, n_ref: int) -> dict | None:
    """The grid's arms ranked by their agreement gain over none averaged (equal weights) over the
    buckets past n_ref, each with its paired 95% interval over sequences."""
    past = np.flatnonzero(edges > n_ref)
    if not len(past):
        return None
    gains = {a.name: {m: gain(tallies, a.name, past, metric=m) for m in METRICS} for a in grid}
    best = max(gains, key=lambda name: gains[name]["agreement"][0])
    return {"buckets": [int(edges[b]) for b in past], "weights": "equal", "gains": gains, "best": best}


def prompt_seed(seed: int, prompt: torch.Tensor) -> tuple[int, int]:
    """The random stream's entropy for decoding ``prompt`` (1, T) under ``--seed seed``: the seed and
    a CRC-32 of the prompt's token ids, the same for every variant run from that prompt."""
    return int(seed), zlib.crc32(np.asarray(prompt.cpu(), dtype=np.int64).tobytes())


def draft_length(drafter, num_draft: int | None) -> int:
    """Drafts per verification: ``num_draft``, or by default a block drafter's ``block_size - 1`` (DFlash:
    the rows of one forward) and a chain of 4 for every other drafter."""
    if num_draft is not None:
        return int(num_draft)
    return drafter.block_size - 1 if drafter_kind(drafter.kind).blocks else 4


def _speculative_record(loop, new_tokens, num_draft, identical, sample, temperature, seed, drafter) -> dict:
    """The result's ``speculative`` entry: how decoding ran, and whether outputs matched (greedy only)."""
    kind = drafter_kind(drafter.kind)
    block = drafter.block_size if kind.blocks else None
    drafting = ("chain: one draft per drafter forward" if not kind.parallel else
                f"block: up to {block - 1} drafts from one drafter forward (block size {block})" if block else
                f"parallel: {num_draft} drafts from one drafter forward (the pending token and {num_draft - 1} mask "
                "tokens)")
    record = {"loop": loop, "new_tokens": new_tokens, "num_draft": num_draft,
              "drafting": drafting,
              "verification": "sampling" if sample else "greedy", "temperature": temperature if sample else None,
              "seed": seed if sample else None, "outputs_identical": None if sample else identical}
    if sample:
        record["outputs_identical_note"] = ("does not apply to sampling: each output is one random draw from the "
                                            "target's distribution, which speculative sampling preserves")
    return record


def _speculative(drafter, reference, loop, texts, edges, specs, buckets, new_tokens, num_draft, progress,
                 saved: SavedUnits, rule, lookup: LookupSettings) -> tuple[bool, dict]:
    """Fill acceptance_length, speedup and their deltas per bucket: one prompt of ``n`` tokens per sequence.

    ``rule(prompt)`` makes a fresh verification rule for one run (the same random stream for every
    run from a prompt). Returns whether every output equalled the baseline's (meaningful for greedy),
    and what drafted each variant (``SpeculativeResult.drafter``; read back from a resumed unit)."""
    runs = [(v, drafter, s) for v, s in specs.items()] + ([("reference", reference, None)] if reference else [])
    identical, drafters = True, {}
    for b, n in enumerate(edges):
        lengths = {v: np.zeros(len(texts)) for v, _, _ in runs}  # per sequence: tokens per target forward
        seconds, decoded = defaultdict(float), defaultdict(int)  # per variant: decode time and tokens
        drafting, rounds = defaultdict(float), defaultdict(int)  # per variant: drafter time and target forwards
        untimed = set()  # variants with a prompt that kept no drafter time (transformers' loop): none for the bucket
        base_seconds, base_decoded = 0.0, 0
        for i, text in enumerate(texts):
            unit = saved.get(f"speculative-{int(n)}-{i:05d}", lambda u: _prompt_unit(u, [v for v, _, _ in runs]))
            if unit is None:
                if progress:
                    progress(f"speculative decoding ({loop}): n = {n}, prompt {i + 1}/{len(texts)}")
                unit = _prompt(loop, drafter, runs, text[:max(int(n) - new_tokens, 2)], new_tokens, num_draft,
                               rule, lookup)
                saved.put(f"speculative-{int(n)}-{i:05d}", unit)
            identical &= unit["identical"]
            drafters.update(unit["drafters"])
            base_seconds += unit["base"][0]
            base_decoded += unit["base"][1]
            for variant, (length, secs, tokens, *timed) in unit["runs"].items():
                lengths[variant][i] = length
                seconds[variant] += secs
                decoded[variant] += tokens
                if timed:
                    drafting[variant] += timed[0]
                    rounds[variant] += int(timed[1])
                else:
                    untimed.add(variant)
        buckets[b]["acceptance_prompts"] = len(texts)
        base_rate = base_seconds / base_decoded if base_decoded else None  # seconds per decoded token
        for variant, _, _ in runs:
            cell = buckets[b][variant]
            cell["acceptance_length"] = _round(float(lengths[variant].mean()))
            cell["acceptance_length_interval"] = _interval(paired_bootstrap(lengths[variant]))
            cell.setdefault("per_sequence", {})["acceptance_length"] = lengths[variant].tolist()  # one prompt each
            rate = seconds[variant] / decoded[variant] if decoded[variant] else None
            cell["speedup"] = _round(base_rate / rate if base_rate and rate else None)
            timed = variant not in untimed and rounds[variant] > 0 and seconds[variant] > 0
            cell["draft_ms_per_round"] = _round(1e3 * drafting[variant] / rounds[variant] if timed else None, 3)
            cell["draft_share"] = _round(drafting[variant] / seconds[variant] if timed else None)
            if variant != "none":
                cell["delta_vs_none"]["acceptance_length"] = _triple(paired_bootstrap(lengths[variant]
                                                                                      - lengths["none"]))
    return identical, drafters


def _prompt_unit(unit, variants: list[str]) -> dict:
    """A saved prompt (``_prompt``'s value) checked against the run's ``variants``: a ``ValueError`` otherwise."""
    if not isinstance(unit, dict) or set(unit) != {"identical", "base", "runs", "drafters"} or not isinstance(
            unit["identical"], bool):
        raise ValueError("expected an object with identical (true or false), base, runs and drafters")
    for name in ("runs", "drafters"):
        if not isinstance(unit[name], dict) or set(unit[name]) != set(variants):
            raise ValueError(f"{name}: expected one entry per variant ({', '.join(variants)})")
    if not all(isinstance(d, str) for d in unit["drafters"].values()):
        raise ValueError("drafters: expected the name of what drafted each variant")
    for where, value, sizes in [("base", unit["base"], (2,))] + [(f"runs[{v!r}]", r, (3, 5))
                                                                 for v, r in unit["runs"].items()]:
        if not (isinstance(value, list) and len(value) in sizes and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 for x in value)):
            raise ValueError(f"{where}: expected {' or '.join(map(str, sizes))} finite numbers >= 0")
    return unit


def _prompt(loop: str, drafter, runs, prompt: list[int], new_tokens: int, num_draft: int, rule,
            lookup: LookupSettings) -> dict:
    """One prompt decoded target-only and by every run, each verified by a fresh ``rule(prompt)``:
    ``{"identical", "base": [seconds, tokens], "runs": {variant: [acceptance length, decode seconds,
    decoded tokens, drafting seconds, target forwards]}, "drafters": {variant: what drafted}}`` (what a resumed
    run keeps; transformers' loop cannot tell drafting from verifying and keeps the first three)."""
    target = drafter.target
    prompt = torch.tensor([prompt], device=drafter.device)
    # chain loop: one target prefill per prompt, shared by the baseline and every variant (each decodes
    # from a copy); transformers' generate prefills in each run
    shared = None if loop == ASSISTED_LOOP else prefill(target, prompt, drafter.chain_drafter(None).feature_ids)
    baseline = _decode(loop, target, None, None, prompt, new_tokens, num_draft, shared, rule(prompt))
    unit = {"identical": True, "base": [baseline.decode_seconds, baseline.decode_tokens], "runs": {}, "drafters": {}}
    for variant, source, s in runs:
        out = _decode(loop, target, source, s, prompt, new_tokens, num_draft, shared, rule(prompt),
                      variant if variant in LOOKUP_VARIANTS else "head", lookup)
        unit["identical"] &= out.tokens == baseline.tokens
        unit["runs"][variant] = [out.acceptance_length, out.decode_seconds, out.decode_tokens] + (
            [] if out.draft_seconds is None else [out.draft_seconds, out.steps])
        unit["drafters"][variant] = out.drafter
    return unit


def _decode(loop: str, target, source, spec: ScaleSpec | None, prompt: torch.Tensor, new_tokens: int,
            num_draft: int, shared: Prefill | None, rule=GREEDY, drafts: str = "head",
            lookup: LookupSettings | None = None) -> SpeculativeResult:
    """One decode by ``loop`` verified by ``rule``: target-only when ``source`` is None, else
    speculative with the drafter adapter ``source`` under ``spec`` (its assistant model, or its
    chain drafter, from the ``shared`` prefill); ``drafts`` ``lookup`` or ``lookup+head``: prompt
    lookup with ``lookup``'s settings, alone or before the chain drafter, in the same chain loop."""
    if loop == ASSISTED_LOOP:
        if source is None:
            return transformers_generate(target, prompt, new_tokens, rule=rule)
        with source.assistant(spec) as assistant:
            return transformers_generate(target, prompt, new_tokens, assistant, num_draft, rule)
    if source is None:
        return target_generate(target, prompt, new_tokens, shared, rule)
    proposer = LookupDrafter(target.get_output_embeddings().weight.shape[0], lookup) if drafts != "head" else None
    chain = proposer if drafts == "lookup" else source.chain_drafter(spec)
    if drafts == "lookup+head":
        chain = LookupThenHead(proposer, chain)
    try:
        return speculative_generate(target, chain, prompt, new_tokens, num_draft, shared, rule)
    finally:
        chain.close()


def _pointer(drafter) -> dict:
    """``{"copy_pointer": its four numbers}`` for a head drafting with a copy pointer, else nothing."""
    pointer = drafter.pointer if drafter_kind(drafter.kind).pointer else None
    return {} if pointer is None else {"copy_pointer": dataclasses.asdict(pointer)}


def _recovered(buckets: list[dict], names: list[str]) -> None:
    """Each variant's share of the reference's gain, where the reference gains (its delta interval lies above 0).

    Where the reference loses or its interval holds 0 there is no gain to share: None."""
    for row in buckets:
        gains = row["reference"]["delta_vs_none"]
        for variant in names:
            if variant in ("none", "reference"):
                continue
            share = {}
            for metric, (mean, lo, hi) in ((m, t) for m, t in gains.items() if t is not None):
                mine = row[variant]["delta_vs_none"].get(metric)
                gains_significantly = lo is not None and lo > 0
                share[metric] = _round(mine[0] / mean) if gains_significantly and mine is not None else None
            row[variant]["recovered"] = share


def _slope(spec: ScaleSpec):
    slopes = spec.slopes()
    if slopes is None:
        return None
    return float(slopes) if slopes.ndim == 0 else float(np.mean(slopes))
