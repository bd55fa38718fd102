"""A copy circuit for an EAGLE-3 head: one more key/value group whose attention finds where the known
token occurred before and brings back the token that followed it.

In one EAGLE-3 layer a copy needs no second layer. Row ``t`` holds the token just known, ``x_{t+1}``, in
its embedding half, and the target's feature at position ``t`` in its hidden half, which carries
``x_t``, the token at that position. So:

* query of row ``t``: a code of ``x_{t+1}``, read from the embedding half;
* key of row ``i``: the same code of ``x_i``, read from the hidden half (a fitted map: the feature
  carries its own token only approximately);
* value of row ``i``: its embedding half, which is ``x_{i+1}``, the token that followed ``x_i``.

Where ``x_i = x_{t+1}`` the query meets its key, and the value is the token to copy, ``x_{t+2}``. The
codes sit in the lowest-frequency RoPE pairs, which turn little over the distances the head sees, so the
match depends on content, not on distance.

The head's own weights are kept: the group is added (one more key/value head and as many query heads
as each group has), so the head keeps its checkpoint format and everything it did, and with a zero
output map it computes exactly what it did before. ``scripts/induction_head.py`` fits the maps.
"""

from __future__ import annotations

import dataclasses

import torch

from calibrate.drafters.eagle3 import Eagle3Head

_ATTENTION = "midlayer.self_attn."


def low_frequency_slots(head_dim: int, pairs: int) -> list[int]:
    """Dimensions of one head, in RoPE's rotate-half layout, of its ``pairs`` lowest-frequency pairs:
    the first halves, then the second halves (pair ``j`` is dimensions ``j`` and ``j + head_dim / 2``)."""
    half = head_dim // 2
    if not 1 <= pairs <= half:
        raise ValueError(f"pairs {pairs}: give 1 to head_dim / 2 = {half}")
    return list(range(half - pairs, half)) + list(range(head_dim - pairs, head_dim))


def rotate_codes(codes: torch.Tensor, inv_freq: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE on codes laid out as :func:`low_frequency_slots` takes them: ``codes`` (T, 2P) with the pairs'
    first halves then their second halves, ``inv_freq`` (P,) the pairs' frequencies, ``positions`` (T,)."""
    pairs = inv_freq.shape[0]
    angle = positions.to(codes.dtype)[:, None] * inv_freq.to(codes.dtype)[None]
    cos, sin = angle.cos(), angle.sin()
    first, second = codes[:, :pairs], codes[:, pairs:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def match_loss(query: torch.Tensor, key: torch.Tensor, same: torch.Tensor, visible: torch.Tensor,
               scaling: float) -> torch.Tensor:
    """Mean over rows that have one of minus the log of the attention mass on the rows holding their
    token: ``query`` (T, c) and ``key`` (T, c) rotated codes, ``same`` (T, T) bool where key row ``i``
    holds the known token of query row ``t``, ``visible`` (T, T) bool the rows a query sees."""
    logits = (query @ key.T * scaling).masked_fill(~visible, float("-inf"))
    target = same & visible
    has = target.any(-1)
    if not has.any():
        return logits.new_zeros(())
    lse = logits[has].logsumexp(-1)
    on_target = logits[has].masked_fill(~target[has], float("-inf")).logsumexp(-1)
    return (lse - on_target).mean()


def with_copy_group(head: Eagle3Head, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    output: torch.Tensor) -> Eagle3Head:
    """A new head: ``head`` plus one key/value group whose first query head is the copy circuit.

    ``query`` (2P, H) reads the embedding half into the group's low-frequency slots, ``key`` (2P, H)
    the hidden half into the same slots (either may be (2P, 2H) instead, reading the whole input
    ``[embedding half, hidden half]``: a match on the token before as well), ``value`` (head_dim, H)
    the embedding half, ``output`` (H, head_dim) writes the first query head's result into the residual.
    The group's other query heads start at zero (no output). The target's shared embedding stays shared.
    """
    c = head.config
    if c.qk_norm or c.rotary_dim != c.head_dim:
        raise ValueError("a copy group is built for heads without q/k norms and with RoPE on every dimension")
    group = c.num_attention_heads // c.num_key_value_heads
    d, hidden = c.head_dim, c.hidden_size
    pairs = query.shape[0] // 2
    if query.shape not in ((2 * pairs, hidden), (2 * pairs, 2 * hidden)) or key.shape[0] != 2 * pairs \
            or key.shape[1] not in (hidden, 2 * hidden):
        raise ValueError(f"query and key maps must be (2P, {hidden}) or (2P, {2 * hidden}) with the same 2P; "
                         f"got {tuple(query.shape)}, {tuple(key.shape)}")
    if value.shape != (d, hidden) or output.shape != (hidden, d):
        raise ValueError(f"value must be ({d}, {hidden}) and output ({hidden}, {d}); "
                         f"got {tuple(value.shape)}, {tuple(output.shape)}")
    config = dataclasses.replace(c, num_attention_heads=c.num_attention_heads + group,
                                 num_key_value_heads=c.num_key_value_heads + 1, head_dim=d)
    grown = Eagle3Head(config, embed_tokens=head.embed_tokens)
    old = head.state_dict()
    new = grown.state_dict()
    for name, tensor in old.items():
        if name != "embed_tokens.weight":
            if not name.startswith(_ATTENTION) or name.endswith("norm.weight"):
                new[name] = tensor
    q0, k0 = c.num_attention_heads * d, c.num_key_value_heads * d
    dtype = old[_ATTENTION + "q_proj.weight"].dtype
    q = torch.zeros(config.num_attention_heads * d, 2 * hidden, dtype=dtype)
    k = torch.zeros(config.num_key_value_heads * d, 2 * hidden, dtype=dtype)
    v = torch.zeros_like(k)
    o = torch.zeros(hidden, config.num_attention_heads * d, dtype=dtype)
    q[:q0], k[:k0] = old[_ATTENTION + "q_proj.weight"], old[_ATTENTION + "k_proj.weight"]
    v[:k0], o[:, :q0] = old[_ATTENTION + "v_proj.weight"], old[_ATTENTION + "o_proj.weight"]
    slots = torch.tensor(low_frequency_slots(d, pairs))
    q[q0 + slots, :query.shape[1]] = query.to(dtype)  # the known token, from the embedding half (first)
    k[k0 + slots, 2 * hidden - key.shape[1]:] = key.to(dtype)  # the row's own token, from the target feature
    v[k0:k0 + d, :hidden] = value.to(dtype)  # the token that followed it
    o[:, q0:q0 + d] = output.to(dtype)
    new.update({_ATTENTION + "q_proj.weight": q, _ATTENTION + "k_proj.weight": k,
                _ATTENTION + "v_proj.weight": v, _ATTENTION + "o_proj.weight": o})
    grown.load_state_dict(new)
    grown.embed_tokens = head.embed_tokens
    return grown.to(next(head.parameters()).device)
