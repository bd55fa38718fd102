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
``reference``
    another head of the same kind, unscaled (a long-trained head), when one is given.

Per bucket and variant:

``mass``
    mean top-k attention mass of the drafter's query rows in the bucket, measured on the queries
    the variant's run attends with (scaled by its spec, over the keys its window keeps), in every
    attention layer (``sharpdraft_theory.mass.topk_mass``, float64).
``agreement``
    teacher-forced top-1 agreement: the drafter's greedy next token equals the target's greedy
    next token, over the same positions (the adapter's ``teacher_forced``; EAGLE-3: the head row
    at position ``t`` predicts token ``t + 2`` from the target feature at ``t`` and token ``t + 1``;
    ``hf`` / ``pard``: the drafter's and the target's next token at ``t``).
``acceptance_length``, ``speedup`` (with ``speculative=True``)
    greedy speculative decoding with chains of ``num_draft`` after a prompt of ``n - new_tokens``
    tokens, one prompt per sequence: tokens committed per target forward that verifies drafts,
    and target-only decode time per token over speculative decode time per token (prefill
    excluded from both; ``calibrate.speculative``). The loop (``speculative.loop``) is the
    kind's: ``transformers-assisted`` for whole causal LMs (``hf``, ``pard``: transformers'
    ``generate(assistant_model=...)``, the variant's spec enabled on the assistant),
    ``sharpdraft-chain`` for the others (``calibrate.speculative.speculative_generate``).
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
    ``{"agreement": [mean, lo, hi], "acceptance_length": [mean, lo, hi]}``: the paired difference
    from ``none`` over the same rows (agreement: pooled over the bucket's rows; acceptance: mean
    over prompts), with a 95% percentile bootstrap interval that resamples **sequences** (rows of
    one sequence are not independent), :func:`paired_bootstrap`.
``recovered``
    where the reference gains (its own ``delta_vs_none`` interval lies above 0): the variant's mean
    delta over the reference's, the share of the long-trained head's gain the variant recovers
    (else None: a loss has no share to recover).

A bucket ``n`` holds the rows with ``n_prev < n <= n_edge`` where ``n`` is the number of keys
the full drafter sees at that row (a window lowers what the row really sees, not its bucket), so
at ``n <= n_ref`` every variant but ``reference`` is the plain drafter (alpha = 1, the window not
yet reached): the table must show no change in those buckets.

Every kind whose registry entry ``evaluates`` (``calibrate.drafters.KINDS``) runs the same way:
the drafter adapter provides the teacher-forced runs and the chain drafter (or, ``assisted``, the
assistant model).
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict

import numpy as np
import torch

from sharpdraft_runtime import causal_mask
from sharpdraft_theory import ScaleSpec
from sharpdraft_theory.bootstrap import RESAMPLES, paired_bootstrap
from sharpdraft_theory.mass import topk_mass
from sharpdraft_theory.stats import DEFAULT_SINKS

from .corpus import pack
from .drafters import drafter_kind
from .errors import UserError
from .speculative import (ASSISTED_LOOP, CHAIN_LOOP, GREEDY, Prefill, Sampling, SpeculativeResult, prefill,
                          speculative_generate, target_generate, transformers_generate)

__all__ = ["VARIANTS", "DEFAULT_VARIANTS", "DEFAULT_SINKS", "default_spec", "variant_specs", "check_variants",
           "bucket_edges", "paired_bootstrap", "MassMeter", "evaluate", "prompt_seed"]

VARIANTS = ("none", "spec", "qwen-logn", "window", "sinks", "reference")  # every variant eval knows
DEFAULT_VARIANTS = ("none", "spec", "qwen-logn", "window", "sinks")  # reference joins when a reference head is given
MAX_LENGTH = 8192  # the longest bucket edge eval accepts


def default_spec(n_ref: int, top_k: int) -> ScaleSpec:
    """The spec used when none is given: log-linear at ``n_ref`` with the tangent slope of
    ``sharpdraft predict``'s default score model (Gaussian background, gap 6, sigma 1):
    ``1 / (gap - sigma^2) = 0.2``. Calibrate the drafter (``sharpdraft calibrate``) for a measured slope."""
    from sharpdraft_theory import Gaussian, tangent_slope

    slope = tangent_slope(Gaussian(gap=6.0, sigma=1.0, top_k=top_k))
    return ScaleSpec(law="log-linear", n_ref=n_ref, slope=round(float(slope), 6), top_k=top_k)


def check_variants(names: list[str], *, window: int | None, sinks: int, has_reference: bool) -> tuple[str, ...]:
    """Validate ``--variants``, ``--window`` and ``--sinks`` (before any model loads); the variants in order."""
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
    names = tuple(names)
    return names if "none" in names else ("none", *names)  # every delta is against none


def variant_specs(spec: ScaleSpec, n_ref: int, variants=DEFAULT_VARIANTS, *, window: int | None = None,
                  sinks: int = DEFAULT_SINKS) -> dict[str, ScaleSpec | None]:
    """The spec of each drafter variant (``reference`` is another drafter and has none here).

    ``window`` W defaults to ``n_ref``; ``sinks`` keeps S sinks and the last W - S keys, so both
    restrictions leave the drafter unchanged at n <= W.
    """
    window = n_ref if window is None else window
    if sinks >= window:
        raise UserError(f"--sinks {sinks}: must be below the window {window} (the drafter's n_ref by default)")

    def baseline(**restriction):
        return ScaleSpec(law="constant", n_ref=None, slope=0.0, top_k=spec.top_k, **restriction)

    made = {"none": None, "spec": spec, "qwen-logn": ScaleSpec(law="qwen-logn", n_ref=n_ref, slope=None,
                                                               top_k=spec.top_k),
            "window": baseline(window=window), "sinks": baseline(window=window - sinks, sinks=sinks)}
    return {v: made[v] for v in variants if v != "reference"}


def bucket_edges(lengths: list[int]) -> np.ndarray:
    """Sorted, distinct bucket upper edges; a row with ``n`` visible keys falls in the first edge >= n."""
    edges = sorted(set(int(n) for n in lengths))
    if not edges or edges[0] < 2 or edges[-1] > MAX_LENGTH:
        raise UserError(f"--lengths {','.join(map(str, lengths))}: give context lengths from 2 to {MAX_LENGTH}, "
                        "e.g. 256,512,1024,2048")
    return np.asarray(edges)


class MassMeter:
    """Mean top-k mass per bucket from attention calls (an ``AttentionTap``).

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
        self.sums = defaultdict(float)
        self.counts = defaultdict(int)

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
            for b, m in zip(np.searchsorted(self.edges, n[sel]), mass.mean(axis=0)):
                self.sums[b] += float(m)
                self.counts[b] += 1

    def result(self) -> dict[int, float | None]:
        return {b: (self.sums[b] / self.counts[b] if self.counts[b] else None) for b in range(len(self.edges))}


def _per_bucket(edges: np.ndarray, n: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Sums of ``values`` (rows,) per bucket of ``n`` (rows,): shape (buckets,); rows past the last edge dropped."""
    b = np.searchsorted(edges, n)
    keep = b < len(edges)
    return np.bincount(b[keep], weights=values[keep].astype(float), minlength=len(edges))


# ----------------------------------------------------------------------------------------------
# The evaluation
# ----------------------------------------------------------------------------------------------

def evaluate(drafter, *, spec: ScaleSpec, lengths: list[int], corpus: str = "pydoc:heldout",
             sequences: int | None = None, skip: int = 0, rows_per_bucket: int = 96, speculative: bool = False,
             new_tokens: int = 32, num_draft: int = 4, variants=DEFAULT_VARIANTS, window: int | None = None,
             sinks: int = DEFAULT_SINKS, reference=None, progress=None, n_ref: int | None = None,
             sample: bool = False, temperature: float = 1.0, seed: int = 0) -> dict:
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
    sample, temperature, seed
        With ``speculative``: speculative sampling at ``temperature`` instead of greedy decoding,
        random streams seeded by ``seed`` and each prompt (:func:`prompt_seed`).
    """
    kind = drafter_kind(drafter.kind, evaluates=True)
    edges = bucket_edges(lengths)
    n_ref = drafter.default_n_ref if n_ref is None else int(n_ref)
    variants = check_variants(list(variants), window=window, sinks=sinks, has_reference=reference is not None)
    if reference is not None and reference.kind != drafter.kind:
        raise UserError(f"--reference-drafter-path: the reference is a {reference.kind} drafter, "
                        f"expected {drafter.kind} like the drafter")
    specs = variant_specs(spec, n_ref, variants, window=window, sinks=sinks)
    texts = list(pack(corpus, drafter.tokenize, drafter.eos_token_id, int(edges[-1]),
                      None if sequences is None else skip + sequences))[skip:]
    if not texts:
        raise UserError(f"--skip {skip}: {corpus} holds no more than {skip} sequences of {edges[-1]} tokens; "
                        "lower --skip or the largest length")
    names = list(specs) + (["reference"] if reference is not None else [])
    meters = {v: MassMeter(edges, spec.top_k, rows_per_bucket, specs.get(v)) for v in names}
    hits = {v: np.zeros((len(texts), len(edges))) for v in names}  # (sequences, buckets) rows agreeing
    rows = np.zeros((len(texts), len(edges)))  # (sequences, buckets) rows per bucket, the same for every variant
    for i, text in enumerate(texts):
        if progress:
            progress(f"sequence {i + 1}/{len(texts)}: teacher-forced, {', '.join(names)}")
        ids = torch.tensor([text])
        forced = drafter.teacher_forced(ids, [(s, meters[v]) for v, s in specs.items()])
        n = np.arange(1, forced.drafted.shape[1] + 1)  # row t: the full drafter sees t + 1 keys (adapters' layout)
        rows[i] = _per_bucket(edges, n, np.ones(len(n)))
        for variant, drafted in zip(specs, forced.drafted):
            hits[variant][i] = _per_bucket(edges, n, (drafted == forced.target_next).cpu().numpy())
        if reference is not None:
            ref = reference.teacher_forced(ids, [(None, meters["reference"])])
            hits["reference"][i] = _per_bucket(edges, n, (ref.drafted[0] == ref.target_next).cpu().numpy())
    buckets = [{"n": int(n), "rows": int(rows[:, b].sum())} for b, n in enumerate(edges)]
    for variant in names:
        mass = meters[variant].result()
        for b, row in enumerate(buckets):
            row[variant] = {"mass": _round(mass[b]),
                            "agreement": _round(hits[variant][:, b].sum() / rows[:, b].sum() if row["rows"] else None),
                            "agreement_interval": _interval(paired_bootstrap(hits[variant][:, b], rows[:, b]))}
            if variant != "none":
                row[variant]["delta_vs_none"] = {
                    "agreement": _triple(paired_bootstrap(hits[variant][:, b] - hits["none"][:, b], rows[:, b]))}
    loop = ASSISTED_LOOP if kind.assisted else CHAIN_LOOP
    all_identical = None
    if speculative:
        def rule(prompt):  # a fresh rule per run: every run from one prompt draws the same stream
            return Sampling(temperature, prompt_seed(seed, prompt)) if sample else GREEDY

        all_identical = _speculative(drafter, reference, loop, texts, edges, specs, buckets, new_tokens, num_draft,
                                     progress, rule)
    if reference is not None:
        _recovered(buckets, names)
    return {
        "drafter": {"kind": drafter.kind, "path": drafter.info.path, "n_ref": n_ref},
        "reference": None if reference is None else {"kind": reference.kind, "path": reference.info.path},
        "corpus": corpus, "skip": skip, "sequences": len(texts), "sequence_length": int(edges[-1]),
        "top_k": spec.top_k, "bootstrap": {"unit": "sequence", "resamples": RESAMPLES, "level": 0.95},
        "variants": {v: (None if s is None else {"law": s.law, "n_ref": s.n_ref, "slope": _slope(s),
                                                 "window": s.window, "sinks": s.sinks})
                     for v, s in specs.items()} | ({"reference": None} if reference is not None else {}),
        "speculative": None if not speculative else _speculative_record(loop, new_tokens, num_draft, all_identical,
                                                                        sample, temperature, seed),
        "buckets": buckets,
    }


def prompt_seed(seed: int, prompt: torch.Tensor) -> tuple[int, int]:
    """The random stream's entropy for decoding ``prompt`` (1, T) under ``--seed seed``: the seed and
    a CRC-32 of the prompt's token ids, the same for every variant run from that prompt."""
    return int(seed), zlib.crc32(np.asarray(prompt.cpu(), dtype=np.int64).tobytes())


def _speculative_record(loop, new_tokens, num_draft, identical, sample, temperature, seed) -> dict:
    """The result's ``speculative`` entry: how decoding ran, and whether outputs matched (greedy only)."""
    record = {"loop": loop, "new_tokens": new_tokens, "num_draft": num_draft,
              "verification": "sampling" if sample else "greedy", "temperature": temperature if sample else None,
              "seed": seed if sample else None, "outputs_identical": None if sample else identical}
    if sample:
        record["outputs_identical_note"] = ("does not apply to sampling: each output is one random draw from the "
                                            "target's distribution, which speculative sampling preserves")
    return record


def _speculative(drafter, reference, loop, texts, edges, specs, buckets, new_tokens, num_draft, progress,
                 rule) -> bool:
    """Fill acceptance_length, speedup and their deltas per bucket: one prompt of ``n`` tokens per sequence.

    ``rule(prompt)`` makes a fresh verification rule for one run (the same random stream for every
    run from a prompt). Returns whether every output equalled the baseline's (meaningful for greedy)."""
    target = drafter.target
    runs = [(v, drafter, s) for v, s in specs.items()] + ([("reference", reference, None)] if reference else [])
    identical = True
    for b, n in enumerate(edges):
        lengths = {v: np.zeros(len(texts)) for v, _, _ in runs}  # per sequence: tokens per target forward
        seconds, decoded = defaultdict(float), defaultdict(int)  # per variant: decode time and tokens
        base_seconds, base_decoded = 0.0, 0
        for i, text in enumerate(texts):
            # decoding runs over positions n - new_tokens .. n, inside the bucket
            prompt = torch.tensor([text[:max(int(n) - new_tokens, 2)]], device=drafter.device)
            if progress:
                progress(f"speculative decoding ({loop}): n = {n}, prompt {i + 1}/{len(texts)}")
            # chain loop: one target prefill per prompt, shared by the baseline and every variant (each decodes
            # from a copy); transformers' generate prefills in each run
            shared = None if loop == ASSISTED_LOOP else prefill(target, prompt, drafter.chain_drafter(None).feature_ids)
            baseline = _decode(loop, target, None, None, prompt, new_tokens, num_draft, shared, rule(prompt))
            base_seconds += baseline.decode_seconds
            base_decoded += baseline.decode_tokens
            for variant, source, s in runs:
                out = _decode(loop, target, source, s, prompt, new_tokens, num_draft, shared, rule(prompt))
                identical &= out.tokens == baseline.tokens
                lengths[variant][i] = out.acceptance_length
                seconds[variant] += out.decode_seconds
                decoded[variant] += out.decode_tokens
        buckets[b]["acceptance_prompts"] = len(texts)
        base_rate = base_seconds / base_decoded if base_decoded else None  # seconds per decoded token
        for variant, _, _ in runs:
            cell = buckets[b][variant]
            cell["acceptance_length"] = _round(float(lengths[variant].mean()))
            cell["acceptance_length_interval"] = _interval(paired_bootstrap(lengths[variant]))
            rate = seconds[variant] / decoded[variant] if decoded[variant] else None
            cell["speedup"] = _round(base_rate / rate if base_rate and rate else None)
            if variant != "none":
                cell["delta_vs_none"]["acceptance_length"] = _triple(paired_bootstrap(lengths[variant]
                                                                                      - lengths["none"]))
    return identical


def _decode(loop: str, target, source, spec: ScaleSpec | None, prompt: torch.Tensor, new_tokens: int,
            num_draft: int, shared: Prefill | None, rule=GREEDY) -> SpeculativeResult:
    """One decode by ``loop`` verified by ``rule``: target-only when ``source`` is None, else
    speculative with the drafter adapter ``source`` under ``spec`` (its assistant model, or its
    chain drafter, from the ``shared`` prefill)."""
    if loop == ASSISTED_LOOP:
        if source is None:
            return transformers_generate(target, prompt, new_tokens, rule=rule)
        with source.assistant(spec) as assistant:
            return transformers_generate(target, prompt, new_tokens, assistant, num_draft, rule)
    if source is None:
        return target_generate(target, prompt, new_tokens, shared, rule)
    chain = source.chain_drafter(spec)
    try:
        return speculative_generate(target, chain, prompt, new_tokens, num_draft, shared, rule)
    finally:
        chain.close()


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


def _triple(values: list[float] | None):
    return None if values is None else [_round(v) for v in values]


def _interval(values: list[float] | None):
    return None if values is None or values[1] is None else [_round(values[1]), _round(values[2])]


def _slope(spec: ScaleSpec):
    slopes = spec.slopes()
    if slopes is None:
        return None
    return float(slopes) if slopes.ndim == 0 else float(np.mean(slopes))


def _round(x: float | None, digits: int = 4):
    return None if x is None or not math.isfinite(x) else round(float(x), digits)
