"""``sharpdraft eval``: does the spec recover the drafter at long context? Measured on held-out text.

For each context-length bucket and each variant - ``none`` (no scaling), ``spec`` (the scale spec
under test) and ``qwen-logn`` (Qwen's log-n query scaling with the drafter's ``n_ref``, the usual
baseline) - it reports:

``mass``
    mean top-k attention mass of the drafter's query rows whose visible-key count ``n`` falls in
    the bucket, after the variant's query scale (``sharpdraft_theory.mass.topk_mass``, float64).
``agreement``
    teacher-forced top-1 agreement: the drafter's greedy next token equals the target's greedy
    next token, over the same positions (EAGLE-3: the head row at position ``t`` predicts token
    ``t + 2`` from the target feature at ``t`` and token ``t + 1``; ``hf`` / ``pard``: the drafter's
    and the target's next token at ``t``).
``acceptance_length``, ``speedup`` (with ``speculative=True``)
    greedy chain speculative decoding (``calibrate.speculative``) after a prompt of ``n`` tokens:
    tokens committed per target forward, and target-only decode time over speculative decode
    time (prefill excluded from both). The output is checked against target-only greedy decoding.

A bucket ``n`` holds the rows with ``n_prev < n_visible <= n`` (``n_prev`` the previous length, 0
for the first), so at ``n <= n_ref`` every variant is the unscaled drafter (alpha = 1 there for
both laws): the table must show no change in those buckets.

Mass of multi-layer drafters (``hf`` / ``pard``) is read on the unscaled run with each row's logits
scaled by its alpha, which is exact for the first layer and an approximation for later ones (whose
inputs the scaling of earlier layers also changes); the EAGLE-3 head has one layer, so it is exact.
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
    each), so the cost does not grow with n^2. ``spec`` (optional) scales each row's logits by its
    ``alpha(n)``; leave it None when the query is already scaled.
    """

    def __init__(self, edges: np.ndarray, top_k: int, rows_per_bucket: int = 96, spec: ScaleSpec | None = None):
        self.edges, self.top_k, self.rows_per_bucket, self.spec = edges, top_k, rows_per_bucket, spec
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
            alpha = 1.0 if self.spec is None else self.spec.alpha(n[sel], layer=layer_idx)
            mass = topk_mass(logits, self.top_k, alpha)  # (heads, r)
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
# Per-kind runners: teacher-forced agreement and mass for one sequence and one variant
# ----------------------------------------------------------------------------------------------

class _Eagle3Runner:
    def __init__(self, drafter):
        from .drafters.eagle3 import feature_layer_ids

        self.drafter, self.head, self.target = drafter, drafter.head, drafter.target
        layers = len(self.target.get_decoder().layers)
        self.feature_ids = self.head.config.aux_layer_ids or feature_layer_ids(layers)
        self.num_layers = layers

    @torch.no_grad()
    def prepare(self, ids: torch.Tensor):
        """Target features and greedy next tokens of one sequence (1, T), computed once."""
        from .drafters.eagle3 import hidden_state_features

        out = hidden_state_features(self.target, ids, (*self.feature_ids, self.num_layers))
        width = out.shape[-1] // 4
        final = out[0, :, 3 * width:]
        target_next = self.target.get_output_embeddings()(final).argmax(-1)  # (T,) target's token after t
        return out[:, :, :3 * width], target_next

    @torch.no_grad()
    def run(self, ids, prepared, spec, meter: MassMeter, agreement: _Agreement) -> None:
        from sharpdraft_runtime import query_hook

        features, target_next = prepared
        scale = query_hook(spec) if spec is not None else None

        def hook(layer_idx, query, key, scaling, n_visible):
            if scale is not None:
                query = scale(layer_idx, query, key, scaling, n_visible)
            meter(layer_idx, query, key, scaling, n_visible)
            return query

        logits = self.head(ids[:, 1:], features[:, :-1], attention_hook=hook).logits[0]  # (T-1, draft)
        drafted = self.head.draft_to_target(logits.argmax(-1))  # row t predicts token t + 2
        T = ids.shape[1]
        agreement.add(np.arange(1, T), (drafted == target_next[1:]).cpu().numpy())

    def chain_drafter(self, spec):
        from .speculative import Eagle3ChainDrafter

        return Eagle3ChainDrafter(self.head, self.num_layers, spec)


class _CausalRunner:
    def __init__(self, drafter, target):
        self.drafter, self.model, self.target = drafter, drafter.model, target

    @torch.no_grad()
    def prepare(self, ids: torch.Tensor):
        return self.target(input_ids=ids).logits[0].argmax(-1)  # (T,) target's token after t

    @torch.no_grad()
    def run(self, ids, target_next, spec, meter: MassMeter, agreement: _Agreement) -> None:
        from sharpdraft_runtime import disable, enable

        from .taps import attention_tap

        meter.spec = spec
        with attention_tap(self.model, meter):
            self.model.base_model(input_ids=ids, use_cache=False)
        if spec is not None:
            enable(self.model, spec)
        try:
            drafted = self.model(input_ids=ids).logits[0].argmax(-1)
        finally:
            if spec is not None:
                disable(self.model)
        agreement.add(np.arange(1, ids.shape[1] + 1), (drafted == target_next).cpu().numpy())

    def chain_drafter(self, spec):
        from .speculative import CausalLMChainDrafter

        if self.model is self.target:
            raise UserError("--speculative needs a drafter different from the target: pass --drafter-path "
                            "(and --target-path for the target)")
        return CausalLMChainDrafter(self.model, spec)


def _runner(drafter, target):
    return _Eagle3Runner(drafter) if drafter.kind == "eagle3" else _CausalRunner(drafter, target)


# ----------------------------------------------------------------------------------------------
# The evaluation
# ----------------------------------------------------------------------------------------------

def evaluate(drafter, target, *, spec: ScaleSpec, lengths: list[int], corpus: str = "pydoc:heldout",
             sequences: int = 4, skip: int = 0, rows_per_bucket: int = 96, speculative: bool = False,
             new_tokens: int = 32, num_draft: int = 4, progress=None) -> dict:
    """Run the evaluation; returns the JSON-ready result (see the module docstring).

    Parameters
    ----------
    drafter : a ``calibrate.drafters`` adapter (``eagle3``, ``hf`` or ``pard``)
    target : the target causal LM (for ``eagle3``, ``drafter.target``)
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
    if drafter.kind not in ("eagle3", "hf", "pard"):
        raise UserError(f"--drafter {drafter.kind}: eval supports eagle3, hf and pard")
    edges = bucket_edges(lengths)
    n_ref = drafter.default_n_ref
    specs = variant_specs(spec, n_ref)
    tokenizer = drafter.tokenizer
    eos = tokenizer.eos_token_id
    texts = list(pack(corpus, drafter.tokenize, [] if eos is None else [eos], int(edges[-1]), skip + sequences))[skip:]
    if not texts:
        raise UserError(f"--skip {skip}: {corpus} holds no more than {skip} sequences of {edges[-1]} tokens; "
                        "lower --skip or the largest length")
    runner = _runner(drafter, target)
    device = drafter.device
    meters = {v: MassMeter(edges, spec.top_k, rows_per_bucket) for v in specs}
    agreements = {v: _Agreement(edges) for v in specs}
    for i, text in enumerate(texts):
        ids = torch.tensor([text], device=device)
        prepared = runner.prepare(ids)
        for variant, s in specs.items():
            if progress:
                progress(f"sequence {i + 1}/{len(texts)}: teacher-forced, {variant}")
            runner.run(ids, prepared, s, meters[variant], agreements[variant])
    buckets = [{"n": int(n), "rows": int(agreements["none"].totals[b])} for b, n in enumerate(edges)]
    for variant in specs:
        mass, agree = meters[variant].result(), agreements[variant].result()
        for b, row in enumerate(buckets):
            row[variant] = {"mass": _round(mass[b]), "agreement": _round(agree[b])}
    all_identical = None
    if speculative:
        all_identical = _speculative(runner, target, texts, edges, specs, buckets, new_tokens, num_draft, progress)
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


def _speculative(runner, target, texts, edges, specs, buckets, new_tokens, num_draft, progress) -> bool:
    """Fill acceptance_length and speedup per bucket: one prompt of ``n`` tokens per sequence."""
    from .speculative import greedy_generate, speculative_generate

    identical = True
    for b, n in enumerate(edges):
        stats = defaultdict(lambda: [0.0, 0.0, 0.0])  # accepted tokens, steps, decode seconds
        base_seconds = 0.0
        for i, text in enumerate(texts):
            # decoding runs over positions n - new_tokens .. n, inside the bucket
            prompt = torch.tensor([text[:max(int(n) - new_tokens, 2)]], device=runner.drafter.device)
            if progress:
                progress(f"speculative decoding: n = {n}, prompt {i + 1}/{len(texts)}")
            reference = greedy_generate(target, prompt, new_tokens)
            base_seconds += reference.decode_seconds
            for variant, s in specs.items():
                chain = runner.chain_drafter(s)
                try:
                    out = speculative_generate(target, chain, prompt, new_tokens, num_draft)
                finally:
                    getattr(chain, "close", lambda: None)()
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
