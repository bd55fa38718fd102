"""Greedy speculative decoding with chain drafting, for measuring acceptance and speed.

Speculative decoding (Leviathan et al., 2023, arXiv:2211.17192; Chen et al., 2023,
arXiv:2302.01318), greedy variant: each step the drafter proposes ``K`` tokens one after the other
(a chain, no tree), the target scores the pending token plus the ``K`` drafts in **one** forward
with its KV cache, the longest prefix of drafts that equals the target's own greedy choices is
accepted, and the target's next choice after it (the correction, or the bonus token when all ``K``
match) is appended. The output is therefore the target's greedy output, token for token.

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
import time
from dataclasses import dataclass

import torch

__all__ = ["CHAIN_LOOP", "ASSISTED_LOOP", "SpeculativeResult", "Prefill", "prefill", "greedy_generate",
           "speculative_generate", "transformers_generate", "target_step", "new_cache", "crop_cache", "cached_forward"]

CHAIN_LOOP = "sharpdraft-chain"  # speculative_generate with a ChainDrafter
ASSISTED_LOOP = "transformers-assisted"  # transformers' generate(assistant_model=...), transformers_generate


@dataclass(frozen=True)
class SpeculativeResult:
    tokens: list[int]  # generated token ids (prompt excluded)
    steps: int  # target forwards that verify drafts (chain loop: after its prefill; transformers: all of them)
    accepted: list[int]  # drafts accepted per step (0 .. K); acceptance length = accepted + 1
    seconds: float  # wall-clock time, prefill included
    decode_seconds: float  # wall-clock time after the target's first forward, its prefill (what drafting speeds up)
    decode_tokens: int  # tokens committed in decode_seconds (after the target's first forward)

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
    return SpeculativeResult(tokens, len(tokens) - 1, [0] * (len(tokens) - 1), t2 - t0, t2 - t1, len(tokens) - 1)


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
    tokens = tokens[:max_new_tokens]  # the last step may commit one past the end
    return SpeculativeResult(tokens, len(accepted_counts), accepted_counts, t2 - t0, t2 - t1, len(tokens) - 1)


@torch.no_grad()
def transformers_generate(target, prompt: torch.Tensor, max_new_tokens: int, assistant=None,
                          num_draft: int = 4) -> SpeculativeResult:
    """Greedy decoding of ``max_new_tokens`` after ``prompt`` (1, T) by transformers' own ``generate``.

    Without ``assistant``: ``target.generate(prompt, do_sample=False)``, target-only greedy decoding
    (the reference output and the speed baseline). With one: assisted generation,
    ``target.generate(prompt, assistant_model=assistant, do_sample=False)``, drafting fixed chains
    of ``num_draft`` (see the module docstring). ``assistant`` is a causal LM of the target's
    vocabulary, a different module from ``target`` (its forwards would be counted as the target's);
    any scale spec is enabled on it by the caller.

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
        with _fixed_chain(assistant, num_draft):
            t0 = time.perf_counter()
            out = target.generate(prompt, attention_mask=torch.ones_like(prompt), assistant_model=assistant,
                                  do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                                  streamer=streamer)
            tokens = out[0, prompt.shape[1]:].tolist()
            t2 = time.perf_counter()
    finally:
        handle.remove()
    committed = streamer.sizes[1:]  # generate's first put is the prompt
    if len(committed) != forwards.count or sum(committed) != len(tokens):
        raise RuntimeError(f"transformers' generate ran {forwards.count} target forwards and committed {committed} "
                           f"tokens, {len(tokens)} in all: not one commit per forward as assisted generation does")
    return SpeculativeResult(tokens, forwards.count, [c - 1 for c in committed], t2 - t0, t2 - forwards.first_end,
                             len(tokens) - committed[0])


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
