"""The evaluation ``sharpdraft eval`` runs: :func:`run_eval` loads and writes, :func:`evaluate` measures.

Per sequence, every teacher-forced arm (the variants, the oracle's grid, the reference head)
shares one target pass (``calibrate.measure.forced``); an online arm runs alone after it
(``calibrate.online``); a drafter that drafts several tokens a forward also gets per-position
metrics at anchors (``calibrate.measure.blocks``); with ``speculative`` each bucket decodes one
prompt per sequence (``calibrate.eval.decode``). On a generated corpus the same pass is also summed by
output position (``calibrate.measure.longgen``). Each finished sequence and prompt is kept
(``calibrate.measure.saved``), so an interrupted run resumed gives the same result. docs/eval.md
documents the result.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import numpy as np
import torch

from sharpdraft_theory.atomic import atomic_write_text
from sharpdraft_theory.bootstrap import RESAMPLES

from ..corpus import is_recall, pack, recall_corpus
from ..drafters import drafter_kind, drafts_in_parallel, load_drafter, resolve_device, resolve_dtype
from ..drafters.pointer import locate
from ..errors import UserError
from ..generated import COPY_ORDER, check_tokenizer, copied_tokens, generated_sequences, is_generated, read_corpus
from ..measure import (METRICS, Arm, MassMeter, SavedUnits, Tally, gain, partial_dir, scale_grid, summarize,
                       tally_sequence)
from ..measure.blocks import block_anchors, block_rows, block_sums, check_block_unit, summarize_blocks
from ..measure.forced import row_masks
from ..measure.longgen import output_edges, regroup, summarize_bins
from ..numbers import rounded
from ..online import (ONLINE_VARIANTS, OnlineOptions, PeakMemory, check_rank, extra_bytes, online_arms, online_pass,
                      tally_online)
from ..speculative import CHAIN_LOOP, GREEDY, Sampling
from .decode import prompt_seed, speculative_buckets, speculative_record
from .options import EvalOptions, refuse_online_pointer
from .variants import LOOKUP_VARIANTS, check_on_drafter, default_spec, describe_spec, variant_specs, with_lookup

__all__ = ["run_eval", "evaluate", "draft_length", "pointer_record", "BLOCK_ANCHORS"]


def run_eval(opts: EvalOptions, *, progress=None) -> dict:
    """Load the drafters of ``opts``, evaluate, and write the result to ``opts.out`` and its plot to
    ``opts.plot``; returns the result, with the weights' device and dtype and the spec files named.

    ``progress(message)``, when given, hears of each sequence and prompt as it starts."""
    saved = SavedUnits(None if opts.out is None else partial_dir(opts.out), opts.to_dict(), opts.resume)
    device = resolve_device(opts.device)
    dtype = resolve_dtype(opts.dtype, device)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    opts.check_online_drafter()
    with torch.inference_mode() if opts.online is None else torch.no_grad():  # online arms learn: autograd on
        drafter = load_drafter(opts.drafter, opts.drafter_path, opts.target_path, device, dtype,
                               pointer_unmatched=opts.pointer_unmatched)
        reference = None if opts.reference_drafter_path is None else load_drafter(
            opts.drafter, opts.reference_drafter_path, opts.target_path, device, dtype)
        result = evaluate(drafter, opts, reference=reference, saved=saved, progress=progress)
    result["weights"] = {"device": device.type, "dtype": str(dtype).removeprefix("torch.")}
    result["spec_file"] = str(opts.spec_file) if opts.spec_file is not None else None
    result["extra_spec_files"] = {name: str(file) for name, file in opts.extra_spec_files.items()} or None
    try:
        if opts.out is not None:
            atomic_write_text(opts.out, json.dumps(result, indent=2) + "\n")
        if opts.plot is not None:
            from ..plots.eval import plot_result

            plot_result(result, opts.plot)
    except OSError as err:
        raise UserError(f"cannot write {err.filename or opts.out}: {err.strerror}; the evaluation was not saved"
                        + ("; --resume reads back what was measured" if opts.out is not None else "")) from None
    saved.finish()
    return result


def evaluate(drafter, opts: EvalOptions, *, reference=None, saved: SavedUnits | None = None, progress=None) -> dict:
    """Run the evaluation of ``opts`` on the loaded ``drafter``; returns the JSON-ready result (docs/eval.md).

    Parameters
    ----------
    drafter : a ``calibrate.drafters`` adapter of the kind ``opts.drafter`` (its ``target`` is the target)
    opts : EvalOptions
        What to measure, checked; here the drafter's own n_ref (unless ``opts.n_ref``), layers, heads and
        block size are checked against it.
    reference : drafter adapter, optional
        The head of ``opts.reference_drafter_path`` (given exactly when it is), run unscaled as ``reference``.
    saved : SavedUnits, optional
        Where finished sequences and prompts are kept and, resuming, read back.
    progress : callable, optional
        ``progress(message)`` as each sequence and prompt starts.
    """
    if drafter.kind != opts.drafter or (reference is None) != (opts.reference_drafter_path is None):
        raise ValueError(f"evaluate: the drafter is {drafter.kind}{' with a reference' if reference else ''}, the "
                         f"options are for {opts.drafter}{' with a reference' if opts.reference_drafter_path else ''}")
    if opts.online is not None and getattr(drafter, "pointer", None) is not None:
        refuse_online_pointer(drafter.info.path, locate(drafter.info.path)[1] if drafter.info.path else "its head")
    kind = drafter_kind(opts.drafter)  # one that evaluates: EvalOptions checked it
    n_ref = drafter.default_n_ref if opts.n_ref is None else int(opts.n_ref)
    spec = default_spec(n_ref, opts.top_k) if opts.spec is None else opts.spec
    check_on_drafter(spec, drafter, opts.drafter, n_ref, f"--spec {opts.spec_file}")
    for name, extra in opts.extra_specs.items():
        check_on_drafter(extra, drafter, opts.drafter, n_ref,
                         f"--extra-spec {name.removeprefix('spec:')}={opts.extra_spec_files.get(name)}")
    num_draft = draft_length(drafter, opts.num_draft)
    block = drafter.block_size if kind.blocks else None
    if block is not None and num_draft > block - 1:
        raise UserError(f"--num-draft {num_draft}: a block of {block} drafts at most {block - 1} tokens a forward; "
                        f"give {block - 1} or fewer (or leave it out)")
    edges = opts.edges
    if drafts_in_parallel(drafter) and num_draft > edges[-1] - 2:
        raise UserError(f"--num-draft {num_draft}: one forward would draft past the sequences of {edges[-1]} tokens; "
                        f"give at most {edges[-1] - 2}")
    recall = is_recall(opts.corpus)
    variants = with_lookup(opts.variants, opts.corpus)
    if opts.speculative and drafter.kind == "pard":
        drafter.pard_token  # noqa: B018 (read now: a PARD drafter without its mask token is refused before any pass)
    lookup = replace(opts.lookup, eos_token_id=drafter.eos_token_id)
    saved = saved or SavedUnits(None, {}, resume=False)
    if reference is not None and reference.kind != drafter.kind:
        raise UserError(f"--reference-drafter-path: the reference is a {reference.kind} drafter, "
                        f"expected {drafter.kind} like the drafter")
    learning = online_arms(variants, spec)
    specs = variant_specs(spec, n_ref, [v for v in variants if v not in ONLINE_VARIANTS], window=opts.window,
                          sinks=opts.sinks, neighbour_window=opts.neighbour_window, group=opts.group,
                          longest=int(edges[-1]))
    specs.update(opts.extra_specs)
    grid = scale_grid(list(opts.slopes), list(opts.alphas), n_ref, spec.top_k)
    arms = ([Arm(v, s, drafts=v if v in LOOKUP_VARIANTS else "head") for v, s in specs.items()] + grid
            + ([Arm("reference", None, other=True)] if reference is not None else []))
    shared = list(arms)  # the arms of the one many-arm pass
    arms += [Arm(a.name, a.spec) for a in learning]
    limit = None if opts.sequences is None else opts.skip + opts.sequences
    generated = None
    if recall:
        recalled = recall_corpus(opts.corpus, drafter.tokenize, drafter.eos_token_id, int(edges[-1]), limit)[opts.skip:]
        texts, copied = [m.ids for m in recalled], [m.copied for m in recalled]
    elif is_generated(opts.corpus):
        check_tokenizer(opts.corpus, drafter.tokenizer, "the drafter's")
        generated = generated_sequences(opts.corpus, int(edges[-1]), limit)[opts.skip:]
        texts, copied = [g.ids for g in generated], [copied_tokens(g.ids) for g in generated]
    else:
        texts = list(pack(opts.corpus, drafter.tokenize, drafter.eos_token_id, int(edges[-1]), limit))[opts.skip:]
        copied = [None] * len(texts)
    if not texts:
        raise UserError(f"--skip {opts.skip}: {opts.corpus} holds no more than {opts.skip} sequences of {edges[-1]} "
                        "tokens; lower --skip or the largest length")
    online = opts.online or OnlineOptions()
    if any(a.method == "online-lora" for a in learning):
        check_rank(drafter.head, online.rank)  # before any pass: the head's widths are known
    tallies, costs, by_bin = [], [], []
    bins = None if generated is None else max(-(-(int(edges[-1]) - g.prompt_length) // opts.bin_size)
                                              for g in generated)  # output bins the longest output reaches
    learners = {}  # online arm -> its learner, kept across sequences with online.carry
    for i, text in enumerate(texts):
        kept = saved.get(f"forced-{i:05d}", lambda d: _forced_unit(d, [a.name for a in arms], len(edges), bins))
        if kept is None:
            if progress:
                progress(f"sequence {i + 1}/{len(texts)}: teacher-forced, {len(shared)} arms"
                         + (f" + {len(learning)} online" if learning else ""))
            # a generated sequence's rows go to finer buckets, each in one context bucket and one output bin
            fine, context, in_bin = (edges, None, None) if generated is None else output_edges(
                edges, generated[i].prompt_length, opts.bin_size)
            began = time.perf_counter()
            with PeakMemory(drafter.device) as peak:
                tally = tally_sequence(drafter, torch.tensor([text]), shared, fine, top_k=spec.top_k,
                                       temperature=opts.temperature, rows_per_bucket=opts.rows_per_bucket,
                                       other=reference, copied=copied[i], lookup=lookup)
            cost = {a.name: _cost("shared", time.perf_counter() - began, len(text) - 1, peak,
                                  None if a.other else extra_bytes(None)) for a in shared}
            for arm in learning:
                if progress:
                    progress(f"sequence {i + 1}/{len(texts)}: {arm.name}")
                cost[arm.name], learners[arm.name] = _online(drafter, text, arm, online, fine, tally, spec.top_k,
                                                             opts.temperature, opts.rows_per_bucket,
                                                             learners.get(arm.name), copied[i])
            binned = None
            if generated is not None:
                binned, tally = regroup(tally, in_bin, bins), regroup(tally, context, len(edges))
            saved.put(f"forced-{i:05d}", {**tally.to_dict(), "costs": cost,
                                          **({} if binned is None else {"output_bins": binned.to_dict()})})
        else:
            tally, cost, binned = kept
        tallies.append(tally)
        costs.append(cost)
        by_bin.append(binned)
    buckets = summarize(tallies, arms, edges)
    blocks = None
    if drafts_in_parallel(drafter):
        blocks = _blocks(drafter, texts, {v: s for v, s in specs.items() if v not in LOOKUP_VARIANTS}, edges,
                         num_draft, opts.temperature, saved, progress)
    names = [a.name for a in arms if a not in grid]
    loop = CHAIN_LOOP
    all_identical = None
    if opts.speculative:
        def rule(prompt):  # a fresh rule per run: every run from one prompt draws the same stream
            return Sampling(opts.temperature, prompt_seed(opts.seed, prompt)) if opts.sample else GREEDY

        all_identical, drafters = speculative_buckets(drafter, reference, loop, texts, edges, specs, buckets,
                                                      opts.new_tokens, num_draft, progress, saved, rule, lookup)
    if reference is not None:
        _recovered(buckets, names)
    return {
        "drafter": {"kind": drafter.kind, "path": drafter.info.path, "n_ref": n_ref, **pointer_record(drafter)},
        "reference": None if reference is None else {"kind": reference.kind, "path": reference.info.path,
                                                     **pointer_record(reference)},
        "corpus": opts.corpus, "skip": opts.skip, "sequences": len(texts), "sequence_length": int(edges[-1]),
        "top_k": spec.top_k, "temperature": opts.temperature,
        "bootstrap": {"unit": "sequence", "resamples": RESAMPLES, "level": 0.95},
        "variants": {a.name: describe_spec(a.spec) for a in arms},  # an online arm: the spec it runs under
        "lookup": lookup.to_dict() if any(a.drafts != "head" for a in arms) else None,
        "recall": {"distances": [m.distance for m in recalled]} if recall else None,
        "generated": None if generated is None else {
            **read_corpus(opts.corpus).to_dict(), "ids": [g.id for g in generated],
            "prompt_lengths": [g.prompt_length for g in generated], "copy_order": COPY_ORDER},
        "output_bins": None if generated is None else {
            "bin_size": opts.bin_size, "bins": summarize_bins(by_bin, [a for a in arms if a not in grid], opts.bin_size)},
        "speculative": None if not opts.speculative else {
            **speculative_record(loop, opts.new_tokens, num_draft, all_identical, opts.sample, opts.temperature,
                                 opts.seed, drafter), "drafters": drafters},
        "oracle": _oracle(tallies, grid, edges, n_ref) if grid else None,
        "blocks": blocks,
        "online": None if not learning else online.to_dict(),
        "costs": _costs(costs, [a.name for a in arms if a not in grid]),
        "buckets": buckets,
    }


def draft_length(drafter, num_draft: int | None) -> int:
    """Drafts per verification: ``num_draft``, or by default a block drafter's ``block_size - 1`` (DFlash:
    the rows of one forward) and a chain of 4 for every other drafter."""
    if num_draft is not None:
        return int(num_draft)
    return drafter.block_size - 1 if drafter_kind(drafter.kind).blocks else 4


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


def _forced_unit(unit, names: list[str], buckets: int, bins: int | None = None) -> tuple[Tally, dict, Tally | None]:
    """A saved sequence (its tally, each arm's cost and, with ``bins``, its tally over that many output bins)
    checked against the run's arm ``names`` and number of ``buckets``: a ``ValueError`` saying what is wrong
    otherwise."""
    if not isinstance(unit, dict) or not isinstance(unit.get("costs"), dict) or set(unit["costs"]) != set(names):
        raise ValueError(f"costs: expected one entry per arm ({', '.join(names)})")
    for name, c in unit["costs"].items():
        if not isinstance(c, dict) or set(c) != set(COST_FIELDS):
            raise ValueError(f"costs[{name!r}]: expected {', '.join(COST_FIELDS)}")
    if (bins is not None) != ("output_bins" in unit):
        raise ValueError("output_bins: expected one on a generated corpus only")
    binned = None if bins is None else Tally.from_dict(unit["output_bins"], names, bins)
    tally = Tally.from_dict({k: v for k, v in unit.items() if k not in ("costs", "output_bins")}, names, buckets)
    return tally, unit["costs"], binned


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
                     "seconds_per_token": rounded(sum(c["seconds"] for c in cells) / tokens, 7) if tokens else None}
    return out


def _oracle(tallies, grid, edges: np.ndarray, n_ref: int) -> dict | None:
    """The grid's arms ranked by their agreement gain over none averaged (equal weights) over the
    buckets past n_ref, each with its paired 95% interval over sequences."""
    past = np.flatnonzero(edges > n_ref)
    if not len(past):
        return None
    gains = {a.name: {m: gain(tallies, a.name, past, metric=m) for m in METRICS} for a in grid}
    best = max(gains, key=lambda name: gains[name]["agreement"][0])
    return {"buckets": [int(edges[b]) for b in past], "weights": "equal", "gains": gains, "best": best}


def pointer_record(drafter) -> dict:
    """``{"copy_pointer": its four numbers}`` for a head drafting with a copy pointer, else nothing."""
    pointer = drafter.pointer if drafter_kind(drafter.kind).pointer else None
    return {} if pointer is None else {"copy_pointer": pointer.to_dict()}


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
                share[metric] = rounded(mine[0] / mean) if gains_significantly and mine is not None else None
            row[variant]["recovered"] = share
