"""Greedy speculative decoding with chain drafting, for measuring acceptance and speed.

Speculative decoding (Leviathan et al., 2023, arXiv:2211.17192; Chen et al., 2023,
arXiv:2302.01318), greedy variant: each step the drafter proposes ``K`` tokens one after the other
(a chain, no tree), the target scores the pending token plus the ``K`` drafts in **one** forward
with its KV cache, the longest prefix of drafts that equals the target's own greedy choices is
accepted, and the target's next choice after it (the correction, or the bonus token when all ``K``
match) is appended. The output is therefore the target's greedy output, token for token; the
tests check it against :func:`greedy_generate`.

State at the start of a step: committed tokens ``x_0 .. x_N``; the target's cache holds
``x_0 .. x_{N-1}``; ``x_N`` (the last correction) is pending. Drafters:

* :class:`Eagle3ChainDrafter` - the EAGLE-3 head (Li et al., 2025, arXiv:2503.01840). Head row
  ``t`` pairs the target feature at ``t`` with token ``t + 1``; its KV cache holds rows
  ``0 .. N-1`` (all with true target features). Drafting step ``j > 1`` feeds the head's own
  output hidden state of the previous row in place of the target feature; those rows are dropped
  after verification and recomputed from the target features the verify pass returns.
* :class:`CausalLMChainDrafter` - any causal LM (``hf``, ``pard``) with its own KV cache, drafting
  greedily one token at a time (PARD's parallel mask-token drafting is not used: chain drafting
  keeps the comparison between variants about the attention alone).

Both take an optional ``spec``: the EAGLE-3 head scales its queries through its attention hook,
a causal LM through ``sharpdraft_runtime.enable``.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch

__all__ = ["SpeculativeResult", "greedy_generate", "speculative_generate", "Eagle3ChainDrafter",
           "CausalLMChainDrafter", "target_step"]


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


def _cache():
    from transformers import DynamicCache
    return DynamicCache()


def _crop(cache, keep: int) -> None:
    """Keep the first ``keep`` positions of a transformers cache (its ``crop`` takes a negative count)."""
    remove = cache.get_seq_length() - keep
    if remove > 0:
        cache.crop(-remove)


def _forward(model, input_ids: torch.Tensor, cache, **kwargs):
    """Cached forward; transformers 5.x renames ``past_key_values`` to ``cache``."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return model(input_ids=input_ids, use_cache=True, **{name: cache}, **kwargs)


def target_step(target, input_ids: torch.Tensor, cache, feature_ids=None):
    """One cached target forward over ``input_ids`` (1, T): ``(logits (T, vocab), features or None)``.

    ``feature_ids`` are ``hidden_states`` indices whose concatenation is returned as
    (1, T, len(ids) * hidden) (the EAGLE-3 features); None asks for none.
    """
    out = _forward(target, input_ids, cache, output_hidden_states=feature_ids is not None)
    feats = None if feature_ids is None else torch.cat([out.hidden_states[i] for i in feature_ids], dim=-1)
    return out.logits[0].float(), feats


@torch.no_grad()
def greedy_generate(target, prompt: torch.Tensor, max_new_tokens: int) -> SpeculativeResult:
    """Target-only greedy decoding with a KV cache: the reference output and the speed baseline."""
    t0 = time.perf_counter()
    cache = _cache()
    logits, _ = target_step(target, prompt, cache)
    tokens = [int(logits[-1].argmax())]
    t1 = time.perf_counter()
    while len(tokens) < max_new_tokens:
        logits, _ = target_step(target, torch.tensor([[tokens[-1]]], device=prompt.device), cache)
        tokens.append(int(logits[-1].argmax()))
    t2 = time.perf_counter()
    return SpeculativeResult(tokens, len(tokens) - 1, [0] * (len(tokens) - 1), t2 - t0, t2 - t1)


@torch.no_grad()
def speculative_generate(target, drafter, prompt: torch.Tensor, max_new_tokens: int,
                         num_draft: int = 4) -> SpeculativeResult:
    """Greedy speculative decoding of ``max_new_tokens`` after ``prompt`` (1, T), chain of ``num_draft``.

    ``drafter`` is an :class:`Eagle3ChainDrafter` or :class:`CausalLMChainDrafter` (anything with
    ``feature_ids``, ``start(prompt, features, pending)``, ``draft(k)`` and
    ``commit(tokens, features)``). The output equals :func:`greedy_generate`'s up to floating-point
    ties (the verify forward scores several tokens at once, decoding scores one).
    """
    if num_draft < 1:
        raise ValueError(f"num_draft must be >= 1, got {num_draft}")
    t0 = time.perf_counter()
    device = prompt.device
    cache = _cache()
    logits, feats = target_step(target, prompt, cache, drafter.feature_ids)
    tokens = [int(logits[-1].argmax())]
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
        _crop(cache, cache.get_seq_length() - (k - accepted))  # keep pending + accepted drafts
        drafter.commit(new, None if feats is None else feats[:, :accepted + 1])
        tokens.extend(new)
        accepted_counts.append(accepted)
    t2 = time.perf_counter()
    return SpeculativeResult(tokens[:max_new_tokens], len(accepted_counts), accepted_counts, t2 - t0, t2 - t1)


class Eagle3ChainDrafter:
    """Chain drafting with an EAGLE-3 head (``calibrate.drafters.eagle3.Eagle3Head``).

    Parameters
    ----------
    head : Eagle3Head
    num_target_layers : int
        Layers of the target, for the default feature indices (2, L//2, L-3).
    spec : ScaleSpec, optional
        Query scaling applied in the head's attention hook (``sharpdraft_runtime``).
    """

    def __init__(self, head, num_target_layers: int, spec=None):
        from calibrate.drafters.eagle3 import feature_layer_ids

        self.head = head
        self.feature_ids = head.config.aux_layer_ids or feature_layer_ids(num_target_layers)
        self.hook = None
        if spec is not None:
            from sharpdraft_runtime import query_hook

            self.hook = query_hook(spec)

    def _run(self, input_ids, hidden, position):
        """Append rows at ``position ..`` to the head's cache; return (draft logits, output hidden)."""
        T = input_ids.shape[1]
        pos = torch.arange(position, position + T, device=input_ids.device)[None]
        out = self.head(input_ids, hidden, position_ids=pos, past_key_values=self.past,
                        attention_hook=self.hook)
        self.past = out.past_key_values
        return out.logits[0, -1], out.hidden_states[:, -1:]

    def start(self, prompt: torch.Tensor, features: torch.Tensor, pending: int) -> None:
        """Rows 0 .. N-1 of the prompt ``x_0 .. x_{N-1}`` with target features, ``x_N = pending``."""
        self.past = None
        ids = torch.cat((prompt[:, 1:], torch.tensor([[pending]], device=prompt.device)), dim=1)
        self.rows = prompt.shape[1]  # rows with true features in the cache
        self.logits, self.hidden = self._run(ids, features, 0)

    def draft(self, k: int) -> list[int]:
        """``k`` greedy drafts (target ids); the extra rows are removed again by :meth:`commit`."""
        drafts = []
        logits, hidden = self.logits, self.hidden
        for j in range(k):
            token = int(self.head.draft_to_target(logits.argmax()))
            drafts.append(token)
            if j + 1 < k:  # the head's own output stands in for the (unknown) target feature
                logits, hidden = self._run(torch.tensor([[token]], device=hidden.device), hidden, self.rows + j)
        return drafts

    def commit(self, new: list[int], features: torch.Tensor) -> None:
        """Keep the true rows, then add rows for the verified positions: features (1, a+1, 3H)."""
        self.past = tuple(x[:, :, :self.rows] for x in self.past)
        ids = torch.tensor([new], device=features.device)  # token after each verified position
        self.logits, self.hidden = self._run(ids, features, self.rows)
        self.rows += len(new)


class CausalLMChainDrafter:
    """Chain drafting with a causal LM that shares the target's vocabulary (``hf``, ``pard``).

    ``spec`` is applied with ``sharpdraft_runtime.enable`` (and removed by :meth:`close`).
    """

    feature_ids = None

    def __init__(self, model, spec=None):
        self.model = model
        self.enabled = spec is not None
        if self.enabled:
            from sharpdraft_runtime import enable

            enable(model, spec)

    def close(self) -> None:
        if self.enabled:
            from sharpdraft_runtime import disable

            disable(self.model)
            self.enabled = False

    def _feed(self, ids: list[int]) -> None:
        device = self.model.get_input_embeddings().weight.device
        out = _forward(self.model, torch.tensor([ids], device=device), self.cache)
        self.next = int(out.logits[0, -1].argmax())

    def start(self, prompt: torch.Tensor, features, pending: int) -> None:
        self.cache = _cache()
        self.committed = prompt.shape[1]  # tokens in the drafter's cache
        _forward(self.model, prompt.to(self.model.get_input_embeddings().weight.device), self.cache)
        self.todo = [pending]  # committed tokens not yet in the cache

    def draft(self, k: int) -> list[int]:
        self._feed(self.todo)
        drafts = [self.next]
        while len(drafts) < k:
            self._feed([drafts[-1]])
            drafts.append(self.next)
        return drafts

    def commit(self, new: list[int], features) -> None:
        self.committed += len(self.todo)
        _crop(self.cache, self.committed)  # drop the drafts' rows; accepted ones are fed again
        self.todo = new
