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

Two loops run it (``sharpdraft eval --speculative`` records which one ran):

``sharpdraft-chain``
    :func:`speculative_generate`, this module's own loop, checked against :func:`greedy_generate`.
    State at the start of a step: committed tokens ``x_0 .. x_N``; the target's cache holds
    ``x_0 .. x_{N-1}``; ``x_N`` (the last correction) is pending. The drafter is any
    ``ChainDrafter`` (``calibrate.drafters.base``) made by a drafter adapter's
    ``chain_drafter(spec)``, e.g. the EAGLE-3 head (``calibrate.drafters.eagle3.Eagle3ChainDrafter``),
    which reads the target's features and so cannot be a transformers assistant.
``transformers-assisted``
    :func:`transformers_generate`: transformers' own assisted generation,
    ``target.generate(prompt, assistant_model=drafter, do_sample=False)``, for drafters that are
    whole causal LMs (``hf``, ``pard``), checked against the same call without an assistant. This
    is the loop users already run; the scale spec rides along on the assistant
    (``sharpdraft_runtime.enable``), and nothing of transformers' loop is copied here: acceptance
    is read from the outside (a forward hook counts the target's forwards, a streamer receives
    what each of them committed).

    Drafts are a fixed chain of ``K``: for the call the assistant's ``generation_config`` says
    ``num_assistant_tokens=K``, ``num_assistant_tokens_schedule="constant"`` (the ``heuristic``
    schedules, which a model's generation config may name, move K between rounds) and
    ``assistant_confidence_threshold=0`` (transformers' default, 0.4, stops a chain as soon as the
    assistant's probability for its token falls below it); its own config is restored after.
    transformers drafts ``min(K, max_new_tokens - generated - 1)`` tokens a round, so the last
    round may verify fewer. Its first target forward prefills the prompt and verifies the first
    chain at once: every run prefills inside ``generate``, none starts from a shared
    :func:`prefill` (handed a pre-filled cache, assisted generation in transformers 5.24 returned
    other tokens than greedy decoding). Generation stops at ``max_new_tokens`` only (no end-of-sequence stop), as the
    chain loop does.

    With :class:`Sampling` the call samples (``do_sample=True``, ``top_k=0``, ``top_p=1.0``:
    transformers' default ``top_k=50`` would truncate both distributions) with the temperature as a
    logits processor (``_decoding`` says why not ``temperature=T``). transformers 5.24 then runs
    Algorithm 1 itself (``generation.utils._speculative_sampling``): the assistant samples its chain
    under the target's logits processors and hands back those processed scores as ``q``; the target
    accepts with ``min(1, p / q)``, resamples from ``norm(max(0, p - q))`` at a rejection and draws
    the bonus token from ``p``; a last round with room for one token drafts nothing and samples the
    target alone (tests/test_sampling.py checks ``q`` and ``p`` at every verification). Its random
    draws come from torch's global generator, seeded from the rule for the call (and restored
    after), so a run repeats; its draws are not the chain loop's.

Measures, the same in both loops (:class:`SpeculativeResult`):

* acceptance length: tokens committed per target forward that verifies drafts. The chain loop's
  prefill forward verifies nothing (it commits the first token), so it is ``(N - 1) / steps``
  there and ``N / forwards`` in transformers' loop, ``N`` the tokens generated;
* decode time: wall-clock time after the prompt's prefill in the target and the drafter (chain
  loop: after both; transformers: after the target's first forward, which comes after the
  assistant's prefill and first chain), with ``decode_tokens``, the tokens committed in that
  time, so that loops whose first forward commits different numbers of tokens compare per token
  (``sharpdraft eval``'s speedup).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from sharpdraft_theory.sampling import accept_probability, inverse_cdf, residual, softmax

__all__ = ["CHAIN_LOOP", "ASSISTED_LOOP", "GREEDY", "Greedy", "Sampling", "SpeculativeResult", "Prefill", "prefill",
           "target_generate", "greedy_generate", "speculative_generate", "transformers_generate", "target_step",
           "new_cache", "crop_cache", "cached_forward"]

CHAIN_LOOP = "sharpdraft-chain"  # speculative_generate with a ChainDrafter
ASSISTED_LOOP = "transformers-assisted"  # transformers' generate(assistant_model=...), transformers_generate


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
        self.torch_seed = int(sequence.generate_state(1, np.uint64)[0])  # for transformers' draws (torch's generator)

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
    steps: int  # target forwards that verify drafts (chain loop: after its prefill; transformers: all of them)
    accepted: list[int]  # drafts accepted per step (0 .. K); acceptance length = accepted + 1
    seconds: float  # wall-clock time, prefill included
    decode_seconds: float  # wall-clock time after the target's first forward, its prefill (what drafting speeds up)
    decode_tokens: int  # tokens committed in decode_seconds (after the target's first forward)
    drafter: str = "none"  # what drafted (the ChainDrafter's name; transformers' loop: assistant; none: target only)
    draft_seconds: float | None = None  # of decode_seconds, in the drafter's draft and commit (chain loop; else None)

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


def _start(target, prompt, feature_ids, shared: Prefill | None, rule) -> tuple[object, int, torch.Tensor | None, float]:
    """(cache to decode into, first token by ``rule``, features, prefill seconds) from ``shared`` or a new prefill."""
    if shared is None:
        shared = prefill(target, prompt, feature_ids)
        return shared.cache, rule.pick(shared.logits)[0], shared.features, shared.seconds
    if feature_ids is not None and shared.feature_ids != tuple(feature_ids):
        raise ValueError(f"the shared prefill holds hidden states {shared.feature_ids}, the drafter reads {feature_ids}")
    return copy.deepcopy(shared.cache), rule.pick(shared.logits)[0], shared.features, shared.seconds


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
def target_generate(target, prompt: torch.Tensor, max_new_tokens: int, shared: Prefill | None = None,
                    rule=GREEDY) -> SpeculativeResult:
    """Target-only decoding with a KV cache, each token picked by ``rule`` (:data:`GREEDY`: argmax;
    :class:`Sampling`: a draw from ``p_T``): the reference output and the speed baseline.

    ``shared``: start from this prefill of ``prompt`` (a copy of its cache) instead of running one.
    """
    cache, first, _, prefill_seconds = _start(target, prompt, None, shared, rule)
    tokens = [first]
    t1 = time.perf_counter()
    t0 = t1 - prefill_seconds
    while len(tokens) < max_new_tokens:
        logits, _ = target_step(target, torch.tensor([[tokens[-1]]], device=prompt.device), cache)
        tokens.append(rule.pick(logits[-1])[0])
    t2 = time.perf_counter()
    return SpeculativeResult(tokens, len(tokens) - 1, [0] * (len(tokens) - 1), t2 - t0, t2 - t1, len(tokens) - 1)


def greedy_generate(target, prompt: torch.Tensor, max_new_tokens: int, shared: Prefill | None = None) -> SpeculativeResult:
    """Target-only greedy decoding: :func:`target_generate` with :data:`GREEDY`."""
    return target_generate(target, prompt, max_new_tokens, shared, GREEDY)


@torch.no_grad()
def speculative_generate(target, drafter, prompt: torch.Tensor, max_new_tokens: int,
                         num_draft: int = 4, shared: Prefill | None = None, rule=GREEDY) -> SpeculativeResult:
    """Speculative decoding of ``max_new_tokens`` after ``prompt`` (1, T), chain of ``num_draft``,
    verified by ``rule`` (:data:`GREEDY` or a :class:`Sampling`).

    ``drafter`` is a ``ChainDrafter`` (``calibrate.drafters.base``: ``name``, ``feature_ids``,
    ``start(prompt, features, pending)``, ``draft(k, rule)``, ``commit(tokens, features)``). Greedy:
    the output equals :func:`greedy_generate`'s up to floating-point ties (the verify forward
    scores several tokens at once, decoding scores one). Sampling: every token follows the target's
    ``p_T``, as :func:`target_generate` with a :class:`Sampling` draws it. ``shared``: start from
    this prefill of ``prompt``.
    """
    if num_draft < 1:
        raise ValueError(f"num_draft must be >= 1, got {num_draft}")
    device = prompt.device
    cache, first, feats, prefill_seconds = _start(target, prompt, drafter.feature_ids, shared, rule)
    t0 = time.perf_counter() - prefill_seconds
    tokens = [first]
    drafter.start(prompt, feats, tokens[0])
    t1 = time.perf_counter()
    accepted_counts, drafting = [], 0.0
    while len(tokens) < max_new_tokens:
        k = min(num_draft, max_new_tokens - len(tokens))  # never draft past the requested length
        t = time.perf_counter()
        drafts, q = drafter.draft(k, rule)  # up to k drafts; q: (len, vocab) their laws (None: greedy)
        drafting += time.perf_counter() - t
        block = torch.tensor([[tokens[-1], *drafts]], device=device)  # pending token + its drafts
        logits, feats = target_step(target, block, cache, drafter.feature_ids)  # (len + 1, vocab)
        accepted, token = rule.verify(drafts, q, logits)
        new = drafts[:accepted] + [token]
        crop_cache(cache, cache.get_seq_length() - (len(drafts) - accepted))  # keep pending + accepted drafts
        t = time.perf_counter()
        drafter.commit(new, None if feats is None else feats[:, :accepted + 1])
        drafting += time.perf_counter() - t
        tokens.extend(new)
        accepted_counts.append(accepted)
    t2 = time.perf_counter()
    tokens = tokens[:max_new_tokens]  # the last step may commit one past the end
    return SpeculativeResult(tokens, len(accepted_counts), accepted_counts, t2 - t0, t2 - t1, len(tokens) - 1,
                             drafter.name, drafting)


@torch.no_grad()
def transformers_generate(target, prompt: torch.Tensor, max_new_tokens: int, assistant=None,
                          num_draft: int = 4, rule=GREEDY) -> SpeculativeResult:
    """Decoding of ``max_new_tokens`` after ``prompt`` (1, T) by transformers' own ``generate``.

    Without ``assistant``: ``target.generate(prompt, do_sample=False)``, target-only greedy decoding
    (the reference output and the speed baseline). With one: assisted generation,
    ``target.generate(prompt, assistant_model=assistant, do_sample=False)``, drafting fixed chains
    of ``num_draft`` (see the module docstring). ``assistant`` is a causal LM of the target's
    vocabulary, a different module from ``target`` (its forwards would be counted as the target's);
    any scale spec is enabled on it by the caller. With a :class:`Sampling` ``rule``: the same
    calls with ``do_sample=True`` at its temperature, torch's generator seeded from it.

    Returns
    -------
    SpeculativeResult
        ``steps``: the target's forward calls during ``generate`` (a forward hook), each committing
        ``accepted + 1`` tokens (what ``generate`` hands its streamer once per forward, after the
        prompt); decode time after the end of the first forward.
    """
    if num_draft < 1:
        raise ValueError(f"num_draft must be >= 1, got {num_draft}")
    if assistant is target:
        raise ValueError("the assistant must be a module other than the target (its forwards would be counted "
                         "as the target's)")
    forwards, streamer = _ForwardClock(), _Committed()
    handle = target.register_forward_hook(forwards)
    try:
        with _fixed_chain(assistant, num_draft), _seeded(rule, prompt.device):
            t0 = time.perf_counter()
            out = target.generate(prompt, attention_mask=torch.ones_like(prompt), assistant_model=assistant,
                                  max_new_tokens=max_new_tokens, eos_token_id=None, streamer=streamer,
                                  **_decoding(rule))
            tokens = out[0, prompt.shape[1]:].tolist()
            t2 = time.perf_counter()
    finally:
        handle.remove()
    committed = streamer.sizes[1:]  # generate's first put is the prompt
    if len(committed) != forwards.count or sum(committed) != len(tokens):
        raise RuntimeError(f"transformers' generate ran {forwards.count} target forwards and committed {committed} "
                           f"tokens, {len(tokens)} in all: not one commit per forward as assisted generation does")
    return SpeculativeResult(tokens, forwards.count, [c - 1 for c in committed], t2 - t0, t2 - forwards.first_end,
                             len(tokens) - committed[0], "none" if assistant is None else "assistant")


class _ForwardClock:
    """A forward hook: counts the module's forward calls and notes when the first one ended."""

    def __init__(self):
        self.count = 0
        self.first_end = None

    def __call__(self, module, args, output) -> None:
        self.count += 1
        if self.count == 1:
            if output.logits.is_cuda:
                torch.cuda.synchronize(output.logits.device)  # kernels run ahead of the host: wait for them
            self.first_end = time.perf_counter()


class _Committed:
    """A transformers streamer (``put`` / ``end``) that keeps the number of tokens of each ``put``."""

    def __init__(self):
        self.sizes = []

    def put(self, value: torch.Tensor) -> None:
        self.sizes.append(value.numel())  # batch 1: (T,) or (1, T)

    def end(self) -> None:
        pass


def _decoding(rule) -> dict:
    """``generate``'s decoding arguments for ``rule``: greedy, or plain sampling at its temperature
    (no top-k, top-p or other truncation, which would change the target's law).

    The temperature goes in as a logits processor with ``temperature=1.0`` in the config: given as
    ``temperature=T``, transformers 5.24 divides the assistant's logits by T twice (the target's
    processors, handed to the assistant's ``generate``, and the assistant's own from the copied
    config), so it drafts from ``softmax(logits / T^2)``; the output keeps the target's law (``q``
    is what it drew from) but acceptance would be that of another temperature."""
    if isinstance(rule, Sampling):
        from transformers import LogitsProcessorList, TemperatureLogitsWarper

        return {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                "logits_processor": LogitsProcessorList([TemperatureLogitsWarper(rule.temperature)])}
    return {"do_sample": False}


@contextlib.contextmanager
def _seeded(rule, device: torch.device):
    """Inside the block torch's generators (CPU, and ``device`` if CUDA) start from ``rule``'s seed
    (a :class:`Sampling`; greedy draws nothing); their states are restored after."""
    if not isinstance(rule, Sampling):
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(rule.torch_seed)
        yield


@contextlib.contextmanager
def _fixed_chain(assistant, num_draft: int):
    """Inside the block, ``assistant`` (None: nothing to do) drafts fixed chains of ``num_draft``
    tokens in transformers' assisted generation; its own generation config is restored after."""
    if assistant is None:
        yield
        return
    own = assistant.generation_config
    fixed = copy.deepcopy(own)
    fixed.num_assistant_tokens = num_draft
    fixed.num_assistant_tokens_schedule = "constant"
    fixed.assistant_confidence_threshold = 0.0
    assistant.generation_config = fixed
    try:
        yield
    finally:
        assistant.generation_config = own
