"""Speculative decoding in ``sharpdraft eval``: one prompt per sequence and bucket, every variant decoded
from it and compared with target-only decoding by the same loop (``calibrate.speculative``).

Acceptance length, speedup and the drafter's share of the time per bucket and variant
(:func:`speculative_buckets`), and the result's ``speculative`` record (:func:`speculative_record`).
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict

import numpy as np
import torch

from sharpdraft_theory import ScaleSpec
from sharpdraft_theory.bootstrap import paired_bootstrap

from ..drafters import drafter_kind, drafts_in_parallel
from ..lookup import LookupProposer, LookupSettings
from ..measure import SavedUnits
from ..numbers import rounded, rounded_interval, rounded_triple
from ..speculative import GREEDY, Prefill, SpeculativeResult, prefill, speculative_generate, target_generate
from .variants import LOOKUP_VARIANTS

__all__ = ["prompt_seed", "speculative_buckets", "speculative_record"]


def prompt_seed(seed: int, prompt: torch.Tensor) -> tuple[int, int]:
    """The random stream's entropy for decoding ``prompt`` (1, T) under ``--seed seed``: the seed and
    a CRC-32 of the prompt's token ids, the same for every variant run from that prompt."""
    return int(seed), zlib.crc32(np.asarray(prompt.cpu(), dtype=np.int64).tobytes())


def speculative_record(loop, new_tokens, num_draft, identical, sample, temperature, seed, drafter) -> dict:
    """The result's ``speculative`` entry: how decoding ran, and whether outputs matched (greedy only)."""
    block = drafter.block_size if drafter_kind(drafter.kind).blocks else None
    drafting = ("chain: one draft per drafter forward" if not drafts_in_parallel(drafter) else
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


def speculative_buckets(drafter, reference, loop, texts, edges, specs, buckets, new_tokens, num_draft, progress,
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
                unit = _prompt(drafter, runs, text[:max(int(n) - new_tokens, 2)], new_tokens, num_draft, rule,
                               lookup)
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
            cell["acceptance_length"] = rounded(float(lengths[variant].mean()))
            cell["acceptance_length_interval"] = rounded_interval(paired_bootstrap(lengths[variant]))
            cell.setdefault("per_sequence", {})["acceptance_length"] = lengths[variant].tolist()  # one prompt each
            rate = seconds[variant] / decoded[variant] if decoded[variant] else None
            cell["speedup"] = rounded(base_rate / rate if base_rate and rate else None)
            timed = variant not in untimed and rounds[variant] > 0 and seconds[variant] > 0
            cell["draft_ms_per_round"] = rounded(1e3 * drafting[variant] / rounds[variant] if timed else None, 3)
            cell["draft_share"] = rounded(drafting[variant] / seconds[variant] if timed else None)
            if variant != "none":
                cell["delta_vs_none"]["acceptance_length"] = rounded_triple(paired_bootstrap(lengths[variant]
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


def _prompt(drafter, runs, prompt: list[int], new_tokens: int, num_draft: int, rule,
            lookup: LookupSettings) -> dict:
    """One prompt decoded target-only and by every run, each verified by a fresh ``rule(prompt)``:
    ``{"identical", "base": [seconds, tokens], "runs": {variant: [acceptance length, decode seconds,
    decoded tokens, drafting seconds, target forwards]}, "drafters": {variant: what drafted}}`` (what a resumed
    run keeps; one saved by transformers' assisted loop, before every kind ran in the one loop, keeps the first
    three)."""
    target = drafter.target
    prompt = torch.tensor([prompt], device=drafter.device)
    # one target prefill per prompt, shared by the baseline and every variant (each decodes from a copy)
    shared = prefill(target, prompt, drafter.feature_ids)
    baseline = _decode(target, None, None, prompt, new_tokens, num_draft, shared, rule(prompt))
    unit = {"identical": True, "base": [baseline.decode_seconds, baseline.decode_tokens], "runs": {}, "drafters": {}}
    for variant, source, s in runs:
        out = _decode(target, source, s, prompt, new_tokens, num_draft, shared, rule(prompt),
                      variant if variant in LOOKUP_VARIANTS else "head", lookup)
        unit["identical"] &= out.tokens == baseline.tokens
        unit["runs"][variant] = [out.acceptance_length, out.decode_seconds, out.decode_tokens] + (
            [] if out.draft_seconds is None else [out.draft_seconds, out.steps])
        unit["drafters"][variant] = out.drafter
    return unit


def _decode(target, source, spec: ScaleSpec | None, prompt: torch.Tensor, new_tokens: int, num_draft: int,
            shared: Prefill | None, rule=GREEDY, drafts: str = "head",
            lookup: LookupSettings | None = None) -> SpeculativeResult:
    """One decode in the one loop verified by ``rule``, from the ``shared`` prefill: target-only when
    ``source`` is None, else speculative with the drafter adapter ``source``'s proposer under ``spec``;
    ``drafts`` ``lookup`` or ``lookup+head``: prompt lookup with ``lookup``'s settings, alone or before
    that proposer."""
    if source is None:
        return target_generate(target, prompt, new_tokens, shared, rule)
    vocab = target.get_output_embeddings().weight.shape[0]
    proposer = source.proposer(spec) if drafts != "lookup" else None
    if drafts != "head":
        proposer = LookupProposer(vocab, lookup, proposer)
    try:
        return speculative_generate(target, proposer, prompt, new_tokens, num_draft, shared, rule)
    finally:
        proposer.close()
