"""transformers' own assisted generation, a cross-check of the one speculative loop (not a loop of the toolkit).

:func:`transformers_generate` runs ``target.generate(prompt, assistant_model=drafter)`` for drafters
that are whole causal LMs, checked against the same call without an assistant; the scale spec rides
along on the assistant (:func:`assistant`, ``sharpdraft_runtime.enable``), and nothing of transformers'
loop is copied here: acceptance is read from the outside (a forward hook counts the target's forwards,
a streamer receives what each of them committed).

Drafts are a fixed chain of ``K``: for the call the assistant's ``generation_config`` says
``num_assistant_tokens=K``, ``num_assistant_tokens_schedule="constant"`` (the ``heuristic`` schedules,
which a model's generation config may name, move K between rounds) and
``assistant_confidence_threshold=0`` (transformers' default, 0.4, stops a chain as soon as the
assistant's probability for its token falls below it); its own config is restored after. transformers
drafts ``min(K, max_new_tokens - generated - 1)`` tokens a round, so the last round may verify fewer.
Its first target forward prefills the prompt and verifies the first chain at once: every run prefills
inside ``generate`` (handed a pre-filled cache, assisted generation in transformers 5.24 returned other
tokens than greedy decoding). Generation stops at ``max_new_tokens`` only (no end-of-sequence stop), as
the toolkit's loop does. Acceptance length there is ``N / forwards`` (its first forward verifies a chain).

With a ``Sampling`` rule the call samples (``do_sample=True``, ``top_k=0``, ``top_p=1.0``: transformers'
default ``top_k=50`` would truncate both distributions) with the temperature as a logits processor
(:func:`_decoding` says why not ``temperature=T``). transformers 5.24 then runs Algorithm 1 itself
(``generation.utils._speculative_sampling``): the assistant samples its chain under the target's logits
processors and hands back those processed scores as ``q``; the target accepts with ``min(1, p / q)``,
resamples from ``norm(max(0, p - q))`` at a rejection and draws the bonus token from ``p``; a last round
with room for one token drafts nothing and samples the target alone (tests/test_sampling.py checks ``q``
and ``p`` at every verification). Its random draws come from torch's global generator, seeded from the
rule for the call (and restored after), so a run repeats; its draws are not the toolkit loop's.
"""

from __future__ import annotations

import contextlib
import copy
import time

import torch

from calibrate.speculative import GREEDY, Sampling, SpeculativeResult
from sharpdraft_runtime import disable, enable

ASSISTED_LOOP = "transformers-assisted"


@contextlib.contextmanager
def assistant(drafter, spec):
    """The causal-LM adapter ``drafter``'s model, ``spec`` enabled on it inside the block (None: unscaled),
    to pass to ``target.generate(..., assistant_model=...)``; the spec is disabled again on leaving."""
    if spec is not None:
        enable(drafter.model, spec)
    try:
        yield drafter.model
    finally:
        if spec is not None:
            disable(drafter.model)


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
