"""Speculative decoding with chain drafting, greedy or sampled, for measuring acceptance and speed.

Speculative decoding (Leviathan et al., 2023, arXiv:2211.17192; Chen et al., 2023,
arXiv:2302.01318): each step the drafter proposes ``K`` tokens one after the other (a chain, no
tree), the target scores the pending token plus the ``K`` drafts in **one** forward with its KV
cache, accepts a prefix of the drafts and appends one token of its own (the correction, or the
bonus token when all ``K`` are accepted). A verification rule decides which:

:data:`GREEDY`
    drafts are the drafter's greedy tokens; the longest prefix equal to the target's own greedy
    choices is accepted, and the target's next choice follows. The output is the target's greedy
    output, token for token.
:class:`Sampling` (``temperature`` T, a seed)
    speculative sampling: each draft is drawn from the drafter's ``q_T = softmax(logits / T)``
    (the drafter's later steps condition on the drawn tokens); draft ``x`` is accepted with
    probability ``min(1, p_T(x) / q_T(x))``; at the first rejection the target draws from
    ``norm(max(0, p_T - q_T))`` and the step ends; when all ``K`` are accepted it draws a bonus
    token from ``p_T``. Every output token follows the target's ``p_T`` exactly
    (``sharpdraft_theory.sampling``, whose float64 functions the rule calls).

One loop runs every drafter, :func:`speculative_generate`: the drafter is a ``Proposer``
(``calibrate.drafters.base``) made by a drafter adapter's ``proposer(spec)``, e.g. the EAGLE-3 head's
chain (``calibrate.drafters.eagle3.Eagle3Proposer``), a DFlash block, PARD's parallel drafts, a causal
LM's chain, prompt lookup, or one of them wrapped by lookup or a copy pointer. Target-only decoding
(:func:`target_generate`, the reference output and the speed baseline) is the same loop with
:class:`NoProposer`, which proposes nothing, so every step verifies the pending token alone.

The path of one token (state at the start of a step: committed tokens ``x_0 .. x_N``; the target's
cache holds ``x_0 .. x_{N-1}``; ``x_N``, the last correction, is pending):

1. **prefill** (once per prompt, :func:`prefill`, shareable by every run from that prompt): the
   target over the prompt; its last logits give the first token by the rule, which is pending; the
   proposer's ``start`` reads the prompt (and the target's features, for a drafter that reads them);
2. **propose**: the proposer's ``propose(k, rule)`` drafts up to ``k`` tokens after ``x_N`` and the
   laws they were drawn from;
3. **verify**: one cached target forward over ``x_N`` and the drafts; the rule accepts a prefix of
   the drafts and picks the target's own next token;
4. **commit**: the accepted drafts and that token are committed (the token is now pending), and the
   proposer's ``commit`` receives them with the target's features of the verified positions (a
   proposer that learns, ``calibrate.online.OnlineProposer``, first receives the target's logits there
   through its optional ``verified``);
5. **crop**: the target's cache drops the rows of the rejected drafts.

Measures (:class:`SpeculativeResult`):

* acceptance length: tokens committed per target forward that verifies drafts. The prefill forward
  verifies nothing (it commits the first token), so it is ``(N - 1) / steps``, ``N`` the tokens
  generated;
* decode time: wall-clock time after the prompt's prefill in the target and the proposer's start,
  with ``decode_tokens``, the tokens committed in that time (``sharpdraft eval``'s speedup), and
  ``draft_seconds``, its part in the proposer's ``propose`` and ``commit`` (None target-only).

transformers' own assisted generation (``generate(assistant_model=...)``) is kept as a cross-check
of this loop in the tests (tests/assisted_generation.py), not as a second loop.
"""

from __future__ import annotations

import copy
import inspect
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from sharpdraft_theory.sampling import accept_probability, inverse_cdf, residual, softmax

__all__ = ["CHAIN_LOOP", "GREEDY", "Greedy", "Sampling", "SpeculativeResult", "Prefill", "prefill", "NoProposer",
           "target_generate", "greedy_generate", "speculative_generate", "target_step", "new_cache", "crop_cache",
           "cached_forward"]

CHAIN_LOOP = "sharpdraft-chain"  # speculative_generate with a Proposer: the loop sharpdraft eval records


class Greedy:
    """Greedy verification (the module docstring): drafts and target tokens are argmaxes."""

    name = "greedy"

    def pick(self, logits: torch.Tensor) -> tuple[int, None]:
        """The token of ``logits`` (V,): its argmax; no distribution is needed to verify it."""
        return int(logits.argmax()), None

    def verify(self, drafts: list[int], q, logits: torch.Tensor) -> tuple[int, int]:
        """``(accepted, token)``: the drafts equal to the target's argmax at each position of ``logits``
        (K + 1, V), then the target's argmax after them. ``q`` is not read."""
        choice = logits.argmax(-1).tolist()  # target's greedy token after each block position
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == choice[accepted]:
            accepted += 1
        return accepted, choice[accepted]


GREEDY = Greedy()


class Sampling:
    """Speculative sampling at ``temperature`` (the module docstring), drawing from one seeded stream.

    Parameters
    ----------
    temperature : float
        T > 0: tokens are drawn from ``softmax(logits / T)``, the drafter's and the target's alike.
    seed : int or sequence of int
        Entropy of the random stream (``numpy.random.SeedSequence``): two rules made with the same
        seed draw the same uniforms in the same order, so runs from one prompt are paired.

    Every draw uses one uniform by inverse CDF (``sharpdraft_theory.sampling.inverse_cdf``), every
    acceptance test one uniform ``u`` (accept when ``u < min(1, p / q)``).
    """

    name = "sampling"

    def __init__(self, temperature: float, seed):
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be finite and > 0, got {temperature}")
        self.temperature = float(temperature)
        sequence = np.random.SeedSequence(seed)
        self.rng = np.random.default_rng(sequence)
        self.torch_seed = int(sequence.generate_state(1, np.uint64)[0])  # torch's generator, for a cross-check's draws

    def probs(self, logits: torch.Tensor) -> np.ndarray:
        """``softmax(logits / T)`` of ``logits`` (..., V), float64."""
        return softmax(logits.detach().double().cpu().numpy(), self.temperature)

    def pick(self, logits: torch.Tensor) -> tuple[int, np.ndarray]:
        """A token drawn from ``softmax(logits / T)`` of ``logits`` (V,), and that law (V,) float64."""
        probs = self.probs(logits)
        return inverse_cdf(probs, self.rng.random()), probs

    def verify(self, drafts: list[int], q: np.ndarray, logits: torch.Tensor) -> tuple[int, int]:
        """``(accepted, token)`` for ``drafts`` drawn from ``q`` (K, V) given the target's ``logits``
        (K + 1, V): drafts accepted until the first rejection, then a residual draw; after K
        acceptances, a draw from the target's last row."""
        for i, x in enumerate(drafts):
            p = self.probs(logits[i])
            if not self.rng.random() < accept_probability(p[x], q[i, x]):
                return i, inverse_cdf(residual(p, q[i]), self.rng.random())
        return len(drafts), inverse_cdf(self.probs(logits[len(drafts)]), self.rng.random())


@dataclass(frozen=True)
class SpeculativeResult:
    tokens: list[int]  # generated token ids (prompt excluded)
    steps: int  # target forwards that verify drafts (after the prefill)
    accepted: list[int]  # drafts accepted per step (0 .. K); acceptance length = accepted + 1
    seconds: float  # wall-clock time, prefill included
    decode_seconds: float  # wall-clock time after the prefill (what drafting speeds up)
    decode_tokens: int  # tokens committed in decode_seconds (after the prefill)
    drafter: str = "none"  # what drafted (the Proposer's name; none: target only)
    draft_seconds: float | None = None  # of decode_seconds, in the proposer's propose and commit (None: target only)

    @property
    def acceptance_length(self) -> float:
        """Tokens committed per target forward: mean of ``accepted + 1`` (1 = no draft ever accepted)."""
        return sum(a + 1 for a in self.accepted) / max(len(self.accepted), 1)


@dataclass(frozen=True)
class Prefill:
    """The target's forward over a prompt, shared by every decoding run from that prompt."""

    cache: object  # transformers KV cache of the prompt; each run decodes from a copy
    logits: torch.Tensor  # (vocab,) the target's logits after the prompt: each run picks its first token there
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
    return Prefill(cache, logits[-1], feats, ids, time.perf_counter() - t0)


def _start(target, prompt, feature_ids, shared: Prefill | None) -> tuple[object, torch.Tensor, torch.Tensor | None, float]:
    """(cache to decode into, the logits after the prompt, features, prefill seconds) from ``shared`` or a new
    prefill."""
    if shared is None:
        shared = prefill(target, prompt, feature_ids)
        return shared.cache, shared.logits, shared.features, shared.seconds
    if feature_ids is not None and shared.feature_ids != tuple(feature_ids):
        raise ValueError(f"the shared prefill holds hidden states {shared.feature_ids}, the drafter reads {feature_ids}")
    return copy.deepcopy(shared.cache), shared.logits, shared.features, shared.seconds


def bar_stop(logits: torch.Tensor, stop: int | None, first: int, min_new_tokens: int) -> torch.Tensor:
    """``logits`` (T, vocab), whose row ``i`` scores output token ``first + i``, with ``stop`` barred (logit
    minus infinity: probability 0, never the argmax) in the rows of output tokens before ``min_new_tokens``;
    the same tensor when no row is barred. The target's law as a generation with a minimum length sees it
    (transformers' ``min_new_tokens``), for target-only decoding and verification alike."""
    rows = min_new_tokens - first
    if stop is None or rows <= 0:
        return logits
    logits = logits.clone()
    logits[:rows, stop] = float("-inf")
    return logits


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


class NoProposer:
    """The proposer that proposes nothing: the loop with it is target-only decoding, one token per
    target forward (the reference output and the speed baseline)."""

    name = "none"
    feature_ids = None

    def start(self, prompt, features, pending: int) -> None:
        """Nothing to read."""

    def propose(self, k: int, rule) -> tuple[list[int], None]:
        return [], None

    def commit(self, new: list[int], features) -> None:
        """Nothing to keep."""

    def close(self) -> None:
        """Nothing to undo."""


def target_generate(target, prompt: torch.Tensor, max_new_tokens: int, shared: Prefill | None = None,
                    rule=GREEDY) -> SpeculativeResult:
    """Target-only decoding with a KV cache, each token picked by ``rule`` (:data:`GREEDY`: argmax;
    :class:`Sampling`: a draw from ``p_T``): :func:`speculative_generate` with :class:`NoProposer`.

    ``shared``: start from this prefill of ``prompt`` (a copy of its cache) instead of running one.
    """
    return speculative_generate(target, NoProposer(), prompt, max_new_tokens, 1, shared, rule)


def greedy_generate(target, prompt: torch.Tensor, max_new_tokens: int, shared: Prefill | None = None) -> SpeculativeResult:
    """Target-only greedy decoding: :func:`target_generate` with :data:`GREEDY`."""
    return target_generate(target, prompt, max_new_tokens, shared, GREEDY)


@torch.no_grad()
def speculative_generate(target, proposer, prompt: torch.Tensor, max_new_tokens: int,
                         num_draft: int = 4, shared: Prefill | None = None, rule=GREEDY,
                         stop: int | None = None, min_new_tokens: int = 0) -> SpeculativeResult:
    """Speculative decoding of ``max_new_tokens`` after ``prompt`` (1, T), up to ``num_draft`` drafts a
    step, verified by ``rule`` (:data:`GREEDY` or a :class:`Sampling`): the module docstring's path.
    ``stop``: a token id (the end-of-sequence token) after which the output ends early; tokens a step
    committed past it are dropped (None: always ``max_new_tokens``). ``min_new_tokens``: ``stop`` is barred
    until the output holds that many tokens (:func:`bar_stop`), so a target that would end early writes on.

    ``proposer`` is a ``Proposer`` (``calibrate.drafters.base``: ``name``, ``feature_ids``,
    ``start(prompt, features, pending)``, ``propose(k, rule)``, ``commit(tokens, features)``). Greedy:
    the output equals target-only decoding's (:class:`NoProposer`) up to floating-point ties (the
    verify forward scores several tokens at once, decoding scores one). Sampling: every token follows
    the target's ``p_T``. ``shared``: start from this prefill of ``prompt``.
    """
    if num_draft < 1:
        raise ValueError(f"num_draft must be >= 1, got {num_draft}")
    device = prompt.device
    cache, after_prompt, feats, prefill_seconds = _start(target, prompt, proposer.feature_ids, shared)
    t0 = time.perf_counter() - prefill_seconds
    first = rule.pick(bar_stop(after_prompt[None], stop, 0, min_new_tokens)[0])[0]
    tokens = [first]
    proposer.start(prompt, feats, tokens[0])
    verified = getattr(proposer, "verified", None)
    t1 = time.perf_counter()
    accepted_counts, drafting = [], 0.0
    stopped = stop is not None and first == stop
    while len(tokens) < max_new_tokens and not stopped:
        k = min(num_draft, max_new_tokens - len(tokens))  # never draft past the requested length
        t = time.perf_counter()
        drafts, q = proposer.propose(k, rule)  # up to k drafts; q: (len, vocab) their laws (None: greedy)
        drafting += time.perf_counter() - t
        block = torch.tensor([[tokens[-1], *drafts]], device=device)  # pending token + its drafts
        logits, feats = target_step(target, block, cache, proposer.feature_ids)  # (len + 1, vocab)
        logits = bar_stop(logits, stop, len(tokens), min_new_tokens)  # row i scores output token len(tokens) + i
        accepted, token = rule.verify(drafts, q, logits)
        new = drafts[:accepted] + [token]
        crop_cache(cache, cache.get_seq_length() - (len(drafts) - accepted))  # keep pending + accepted drafts
        t = time.perf_counter()
        if verified is not None:  # a proposer that learns reads the target's law at the verified positions
            verified(logits[:accepted + 1])
        proposer.commit(new, None if feats is None else feats[:, :accepted + 1])
        drafting += time.perf_counter() - t
        tokens.extend(new)
        accepted_counts.append(accepted)
        if stop is not None and stop in new:
            del tokens[len(tokens) - len(new) + new.index(stop) + 1:]
            stopped = True
    t2 = time.perf_counter()
    tokens = tokens[:max_new_tokens]  # the last step may commit one past the end
    return SpeculativeResult(tokens, len(accepted_counts), accepted_counts, t2 - t0, t2 - t1, len(tokens) - 1,
                             proposer.name, None if isinstance(proposer, NoProposer) else drafting)
