"""``sharpdraft eval``: does the spec recover the drafter at long context? Measured on held-out text.

For each context-length bucket and each variant - ``none`` (no scaling), ``spec`` (the scale spec
under test) and ``qwen-logn`` (Qwen's log-n query scaling with the drafter's ``n_ref``, the usual
baseline) - it reports:

``mass``
    mean top-k attention mass of the drafter's query rows whose visible-key count ``n`` falls in
    the bucket, measured on the queries the variant's run attends with (scaled by its spec), in
    every attention layer (``sharpdraft_theory.mass.topk_mass``, float64).
``agreement``
    teacher-forced top-1 agreement: the drafter's greedy next token equals the target's greedy
    next token, over the same positions (the adapter's ``teacher_forced``; EAGLE-3: the head row
    at position ``t`` predicts token ``t + 2`` from the target feature at ``t`` and token ``t + 1``;
    ``hf`` / ``pard``: the drafter's and the target's next token at ``t``).
``acceptance_length``, ``speedup`` (with ``speculative=True``)
    greedy chain speculative decoding (``calibrate.speculative``) after a prompt of ``n`` tokens:
    tokens committed per target forward, and target-only decode time over speculative decode
    time (prefill excluded from both). The output is checked against target-only greedy decoding.

A bucket ``n`` holds the rows with ``n_prev < n_visible <= n`` (``n_prev`` the previous length, 0
for the first), so at ``n <= n_ref`` every variant is the unscaled drafter (alpha = 1 there for
both laws): the table must show no change in those buckets.

Every kind whose registry entry ``evaluates`` (``calibrate.drafters.KINDS``) runs the same way:
the drafter adapter provides the teacher-forced runs and the chain drafter.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from sharpdraft_theory import ScaleSpec
from sharpdraft_theory.mass import topk_mass

from .corpus import pack
from .drafters import drafter_kind
from .errors import UserError

__all__ = ["VARIANTS", "default_spec", "variant_specs", "bucket_edges", "MassMeter", "evaluate"]

VARIANTS = ("none", "spec", "qwen-logn")


def default_spec(n_ref: int, top_k: int) -> ScaleSpec:
    """The spec used when none is given: log-linear at ``n_ref`` with the tangent slope of
    ``sharpdraft predict``'s default score model (Gaussian background, gap 6, sigma 1):
    ``1 / (gap - sigma^2) = 0.2``. Calibrate the drafter (``sharpdraft calibrate``) for a measured slope."""
    from sharpdraft_theory import Gaussian, tangent_slope

    slope = tangent_slope(Gaussian(gap=6.0, sigma=1.0, top_k=top_k))
    return ScaleSpec(law="log-linear", n_ref=n_ref, slope=round(float(slope), 6), top_k=top_k)


def variant_specs(spec: ScaleSpec, n_ref: int) -> dict[str, ScaleSpec | None]:
    """``{"none": None, "spec": spec, "qwen-logn": qwen-logn at n_ref}``."""
    return {"none": None, "spec": spec,
            "qwen-logn": ScaleSpec(law="qwen-logn", n_ref=n_ref, slope=None, top_k=spec.top_k)}


def bucket_edges(lengths: list[int]) -> np.ndarray:
    """Sorted, distinct bucket upper edges; a row with ``n`` visible keys falls in the first edge >= n."""
    edges = sorted(set(int(n) for n in lengths))
    if not edges or edges[0] < 2:
        raise UserError(f"--lengths {','.join(map(str, lengths))}: give context lengths >= 2, e.g. 256,512,1024,2048")
    return np.asarray(edges)


class MassMeter:
    """Mean top-k mass per bucket from attention calls (an ``AttentionTap``).

    Up to ``rows_per_bucket`` query rows per bucket, evenly spaced, are measured (all heads of
    each), so the cost does not grow with n^2. The meter reads the query as it comes: show it the
    scaled query (``calibrate.taps.ScalingTap``) to measure a spec.
    """

    def __init__(self, edges: np.ndarray, top_k: int, rows_per_bucket: int = 96):
        self.edges, self.top_k, self.rows_per_bucket = edges, top_k, rows_per_bucket
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
        n = n_visible[0].cpu().numpy()  # (q,), one sequence per call
        rows = self._rows(n)
        if len(rows) == 0:
            return
        groups = query.shape[1] // key.shape[1]
        k = key[0].float().repeat_interleave(groups, dim=0)  # (heads, k_len, D)
        for start in range(0, len(rows), 32):
            sel = rows[start:start + 32]
            q = query[0, :, torch.as_tensor(sel, device=query.device)].float()  # (heads, r, D)
            logits = (q @ k.transpose(-1, -2) * scaling).double().cpu().numpy()  # (heads, r, k_len)
            visible = np.arange(logits.shape[-1])[None, :] < n[sel][:, None]  # (r, k_len)
            logits = np.where(visible[None], logits, -np.inf)
            mass = topk_mass(logits, self.top_k)  # (heads, r)
            for b, m in zip(np.searchsorted(self.edges, n[sel]), mass.mean(axis=0)):
                self.sums[b] += float(m)
                self.counts[b] += 1

    def result(self) -> dict[int, float | None]:
        return {b: (self.sums[b] / self.counts[b] if self.counts[b] else None) for b in range(len(self.edges))}


@dataclass
class _Agreement:
    edges: np.ndarray
    hits: np.ndarray | None = None
    totals: np.ndarray | None = None

    def add(self, n: np.ndarray, match: np.ndarray) -> None:
        b = np.searchsorted(self.edges, n)
        keep = b < len(self.edges)
        size = len(self.edges)
        hits = np.bincount(b[keep], weights=match[keep].astype(float), minlength=size)
        totals = np.bincount(b[keep], minlength=size)
        self.hits = hits if self.hits is None else self.hits + hits
        self.totals = totals if self.totals is None else self.totals + totals

    def result(self) -> dict[int, float | None]:
        return {b: (float(self.hits[b] / self.totals[b]) if self.totals[b] else None) for b in range(len(self.edges))}


# ----------------------------------------------------------------------------------------------
# The evaluation
# ----------------------------------------------------------------------------------------------

def evaluate(drafter, *, spec: ScaleSpec, lengths: list[int], corpus: str = "pydoc:heldout",
             sequences: int = 4, skip: int = 0, rows_per_bucket: int = 96, speculative: bool = False,
             new_tokens: int = 32, num_draft: int = 4, progress=None) -> dict:
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
    sequences : int
        At most this many sequences of ``max(lengths)`` tokens.
    skip : int
        Sequences to pass over first (e.g. those of ``pydoc:train`` a demo head was trained on).
    """
    drafter_kind(drafter.kind, evaluates=True)
    edges = bucket_edges(lengths)
    n_ref = drafter.default_n_ref
    specs = variant_specs(spec, n_ref)
    texts = list(pack(corpus, drafter.tokenize, drafter.eos_token_id, int(edges[-1]), skip + sequences))[skip:]
    if not texts:
        raise UserError(f"--skip {skip}: {corpus} holds no more than {skip} sequences of {edges[-1]} tokens; "
                        "lower --skip or the largest length")
    meters = {v: MassMeter(edges, spec.top_k, rows_per_bucket) for v in specs}
    agreements = {v: _Agreement(edges) for v in specs}
    for i, text in enumerate(texts):
        if progress:
            progress(f"sequence {i + 1}/{len(texts)}: teacher-forced, {', '.join(specs)}")
        forced = drafter.teacher_forced(torch.tensor([text]), [(s, meters[v]) for v, s in specs.items()])
        n = forced.n_visible.cpu().numpy()
        for variant, drafted in zip(specs, forced.drafted):
            agreements[variant].add(n, (drafted == forced.target_next).cpu().numpy())
    buckets = [{"n": int(n), "rows": int(agreements["none"].totals[b])} for b, n in enumerate(edges)]
    for variant in specs:
        mass, agree = meters[variant].result(), agreements[variant].result()
        for b, row in enumerate(buckets):
            row[variant] = {"mass": _round(mass[b]), "agreement": _round(agree[b])}
    all_identical = None
    if speculative:
        all_identical = _speculative(drafter, texts, edges, specs, buckets, new_tokens, num_draft, progress)
    return {
        "drafter": {"kind": drafter.kind, "path": drafter.info.path, "n_ref": n_ref},
        "corpus": corpus, "skip": skip, "sequences": len(texts), "sequence_length": int(edges[-1]),
        "top_k": spec.top_k,
        "variants": {v: (None if s is None else {"law": s.law, "n_ref": s.n_ref, "slope": _slope(s)})
                     for v, s in specs.items()},
        "speculative": None if not speculative else {"new_tokens": new_tokens, "num_draft": num_draft,
                                                     "outputs_identical": all_identical},
        "buckets": buckets,
    }


def _speculative(drafter, texts, edges, specs, buckets, new_tokens, num_draft, progress) -> bool:
    """Fill acceptance_length and speedup per bucket: one prompt of ``n`` tokens per sequence."""
    from .speculative import greedy_generate, speculative_generate

    target = drafter.target
    identical = True
    for b, n in enumerate(edges):
        stats = defaultdict(lambda: [0.0, 0.0, 0.0])  # accepted tokens, steps, decode seconds
        base_seconds = 0.0
        for i, text in enumerate(texts):
            # decoding runs over positions n - new_tokens .. n, inside the bucket
            prompt = torch.tensor([text[:max(int(n) - new_tokens, 2)]], device=drafter.device)
            if progress:
                progress(f"speculative decoding: n = {n}, prompt {i + 1}/{len(texts)}")
            reference = greedy_generate(target, prompt, new_tokens)
            base_seconds += reference.decode_seconds
            for variant, s in specs.items():
                chain = drafter.chain_drafter(s)
                try:
                    out = speculative_generate(target, chain, prompt, new_tokens, num_draft)
                finally:
                    chain.close()
                identical &= out.tokens == reference.tokens
                acc = stats[variant]
                acc[0] += sum(a + 1 for a in out.accepted)
                acc[1] += len(out.accepted)
                acc[2] += out.decode_seconds
        buckets[b]["acceptance_prompts"] = len(texts)
        for variant in specs:
            tokens, steps, seconds = stats[variant]
            buckets[b][variant]["acceptance_length"] = _round(tokens / steps if steps else None)
            buckets[b][variant]["speedup"] = _round(base_seconds / seconds if seconds else None)
    return identical


def _slope(spec: ScaleSpec):
    slopes = spec.slopes()
    if slopes is None:
        return None
    return float(slopes) if slopes.ndim == 0 else float(np.mean(slopes))


def _round(x: float | None, digits: int = 4):
    return None if x is None or not math.isfinite(x) else round(float(x), digits)
