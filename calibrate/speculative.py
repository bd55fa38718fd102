"""Greedy speculative decoding with chain drafting, for measuring acceptance and speed.

Speculative decoding (Leviathan et al., 2023, arXiv:2211.17192; Chen et al., 2023,
arXiv:2302.01318), greedy variant: each step the drafter proposes ``K`` tokens one after the other
(a chain, no tree), the target scores the pending token plus the ``K`` drafts in **one** forward
with its KV cache, the longest prefix of drafts that equals the target's own greedy choices is
accepted, and the target's next choice after it (the correction, or the bonus token when all ``K``
match) is appended. The output is therefore the target's greedy output, token for token; the
tests check it against :func:`greedy_generate`.

State at the start of a step: committed tokens ``x_0 .. x_N``; the target's cache holds
``x_0 .. x_{N-1}``; ``x_N`` (the last correction) is pending. The drafter is any
``ChainDrafter`` (``calibrate.drafters.base``), made by a drafter adapter's ``chain_drafter(spec)``:
the EAGLE-3 head (``calibrate.drafters.eagle3.Eagle3ChainDrafter``) or a causal LM with its own
KV cache (``calibrate.drafters.hf.CausalLMChainDrafter``), with or without a scale spec.
"""

from __future__ import annotations

import copy
import inspect
import time
from dataclasses import dataclass

import torch

__all__ = ["SpeculativeResult", "Prefill", "prefill", "greedy_generate", "speculative_generate", "target_step",
           "new_cache", "crop_cache", "cached_forward"]


@dataclass(frozen=True)
class SpeculativeResult:
    tokens: list[int]  # generated token ids (prompt excluded)
    steps: int  # target verification forwards (the first prefill excluded)
    accepted: list[int]  # drafts accepted per step (0 .. K); acceptance length = accepted + 1
    seconds: float  # wall-clock time, prefill included
    decode_seconds: float  # wall-clock time after the prompt's prefill (the part drafting speeds up)

    @property
    def acceptance_length(self) -> float:
        """Tokens committed per target forward: mean of ``accepted + 1`` (1 = no draft ever accepted)."""
        return sum(a + 1 for a in self.accepted) / max(len(self.accepted), 1)


@dataclass(frozen=True)
class Prefill:
    """The target's forward over a prompt, shared by every decoding run from that prompt."""

    cache: object  # transformers KV cache of the prompt; each run decodes from a copy
    first: int  # the target's greedy token after the prompt
    features: torch.Tensor | None  # (1, T, len(ids) * hidden) hidden states at ``feature_ids``, or None
    feature_ids: tuple[int, ...] | None  # the hidden_states indices in ``features``
    seconds: float  # wall-clock time of the forward


@torch.no_grad()
def prefill(target, prompt: torch.Tensor, feature_ids=None) -> Prefill:
    """Run the target once over ``prompt`` (1, T), keeping ``hidden_states[feature_ids]`` if asked.

    Several runs from one prompt (target-only greedy, then one speculative run per drafter variant)
    start from one prefill: for long prompts the prefill is most of a run's time.
    """
    t0 = time.perf_counter()
    cache = new_cache()
    logits, feats = target_step(target, prompt, cache, feature_ids)
    ids = None if feature_ids is None else tuple(feature_ids)
    return Prefill(cache, int(logits[-1].argmax()), feats, ids, time.perf_counter() - t0)


def _start(target, prompt, feature_ids, shared: Prefill | None) -> tuple[object, int, torch.Tensor | None, float]:
    """(cache to decode into, first token, features, prefill seconds) from ``shared`` or a new prefill."""
    if shared is None:
        shared = prefill(target, prompt, feature_ids)
        return shared.cache, shared.first, shared.features, shared.seconds
    if feature_ids is not None and shared.feature_ids != tuple(feature_ids):
        raise ValueError(f"the shared prefill holds hidden states {shared.feature_ids}, the drafter reads {feature_ids}")
    return copy.deepcopy(shared.cache), shared.first, shared.features, shared.seconds


def new_cache():
    """An empty transformers KV cache."""
    from transformers import DynamicCache
    return DynamicCache()


def crop_cache(cache, keep: int) -> None:
    """Keep the first ``keep`` positions of a transformers cache (its ``crop`` takes a negative count)."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


def cached_forward(model, input_ids: torch.Tensor, cache, **kwargs):
    """Cached forward; transformers 5.x renames ``past_key_values`` to ``cache``."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return model(input_ids=input_ids, use_cache=True, **{name: cache}, **kwargs)


def target_step(target, input_ids: torch.Tensor, cache, feature_ids=None):
    """One cached target forward over ``input_ids`` (1, T): ``(logits (T, vocab), features or None)``.

    ``feature_ids`` are ``hidden_states`` indices whose concatenation is returned as
    (1, T, len(ids) * hidden) (the EAGLE-3 features); None asks for none.
    """
    out = cached_forward(target, input_ids, cache, output_hidden_states=feature_ids is not None)
    feats = None if feature_ids is None else torch.cat([out.hidden_states[i] for i in feature_ids], dim=-1)
    return out.logits[0].float(), feats


@torch.no_grad()
def greedy_generate(target, prompt: torch.Tensor, max_new_tokens: int, shared: Prefill | None = None) -> SpeculativeResult:
    """Target-only greedy decoding with a KV cache: the reference output and the speed baseline.

    ``shared``: start from this prefill of ``prompt`` (a copy of its cache) instead of running one.
    """
    cache, first, _, prefill_seconds = _start(target, prompt, None, shared)
    tokens = [first]
    t1 = time.perf_counter()
    t0 = t1 - prefill_seconds
    while len(tokens) < max_new_tokens:
        logits, _ = target_step(target, torch.tensor([[tokens[-1]]], device=prompt.device), cache)
        tokens.append(int(logits[-1].argmax()))
    t2 = time.perf_counter()
    return SpeculativeResult(tokens, len(tokens) - 1, [0] * (len(tokens) - 1), t2 - t0, t2 - t1)


@torch.no_grad()
def speculative_generate(target, drafter, prompt: torch.Tensor, max_new_tokens: int,
                         num_draft: int = 4, shared: Prefill | None = None) -> SpeculativeResult:
    """Greedy speculative decoding of ``max_new_tokens`` after ``prompt`` (1, T), chain of ``num_draft``.

    ``drafter`` is a ``ChainDrafter`` (``calibrate.drafters.base``: ``feature_ids``,
    ``start(prompt, features, pending)``, ``draft(k)``, ``commit(tokens, features)``). The output
    equals :func:`greedy_generate`'s up to floating-point ties (the verify forward scores several
    tokens at once, decoding scores one). ``shared``: start from this prefill of ``prompt``.
    """
    if num_draft < 1:
        raise ValueError(f"num_draft must be >= 1, got {num_draft}")
    device = prompt.device
    cache, first, feats, prefill_seconds = _start(target, prompt, drafter.feature_ids, shared)
    t0 = time.perf_counter() - prefill_seconds
    tokens = [first]
    drafter.start(prompt, feats, tokens[0])
    t1 = time.perf_counter()
    accepted_counts = []
    while len(tokens) < max_new_tokens:
        k = min(num_draft, max_new_tokens - len(tokens))  # never draft past the requested length
        drafts = drafter.draft(k)
        block = torch.tensor([[tokens[-1], *drafts]], device=device)  # pending token + K drafts
        logits, feats = target_step(target, block, cache, drafter.feature_ids)
        choice = logits.argmax(-1).tolist()  # target's greedy token after each block position
        accepted = 0
        while accepted < k and drafts[accepted] == choice[accepted]:
            accepted += 1
        new = drafts[:accepted] + [choice[accepted]]
        crop_cache(cache, cache.get_seq_length() - (k - accepted))  # keep pending + accepted drafts
        drafter.commit(new, None if feats is None else feats[:, :accepted + 1])
        tokens.extend(new)
        accepted_counts.append(accepted)
    t2 = time.perf_counter()
    return SpeculativeResult(tokens[:max_new_tokens], len(accepted_counts), accepted_counts, t2 - t0, t2 - t1)
