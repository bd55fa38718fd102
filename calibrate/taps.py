"""Attention taps for transformers models: see post-RoPE queries and keys, change nothing.

transformers dispatches every attention call of a modern model through ``AttentionInterface``
(``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``) with the post-RoPE ``query``
(batch, heads, q_len, head_dim) and ``key`` (batch, kv_heads, k_len, head_dim). We register one
function, ``"sharpdraft-tap"``, that hands them to the active tap and then runs transformers' own
``sdpa_attention_forward``, so the model's outputs are those of ``attn_implementation="sdpa"``
bit for bit. The same name is registered with ``AttentionMaskInterface`` (sdpa's mask builder):
an implementation without a mask function gets ``attention_mask=None``, which would silently
drop padding masks. See https://huggingface.co/docs/transformers/attention_interface.

``attention_tap(model, tap)`` switches a model to the tap for the duration of a ``with`` block
and restores its previous implementation afterwards. hf, pard and DFlash drafters use it.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .drafters.base import AttentionTap

__all__ = ["TAP_IMPLEMENTATION", "attention_tap", "visible_keys"]

TAP_IMPLEMENTATION = "sharpdraft-tap"
_ACTIVE: contextvars.ContextVar[AttentionTap | None] = contextvars.ContextVar("sharpdraft_tap", default=None)


def visible_keys(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                 is_causal: bool) -> torch.LongTensor:
    """Visible keys per query, shape (batch, q_len), for masks whose visible keys are a prefix.

    ``attention_mask`` is what sdpa receives: None (then causal means bottom-right aligned, as
    in prefill after a cache: query ``i`` sees ``k_len - q_len + i + 1`` keys), a boolean mask
    (batch or 1, 1 or heads, q_len, k_len) with True = visible, or an additive float mask.
    """
    batch, _, q_len, _ = query.shape
    k_len = key.shape[2]
    if attention_mask is None:
        if is_causal and q_len > 1:
            n = torch.arange(k_len - q_len + 1, k_len + 1, device=query.device)
        else:
            n = torch.full((q_len,), k_len, device=query.device)
        return n.expand(batch, q_len)
    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    return visible[:, 0].sum(-1).expand(batch, q_len).long()  # (batch, q_len)


def _tap_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs):
    tap = _ACTIVE.get()
    if tap is not None:
        is_causal = kwargs.get("is_causal")
        is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        n_visible = visible_keys(query, key, attention_mask, is_causal)
        tap(module.layer_idx, query, key, query.shape[-1] ** -0.5 if scaling is None else scaling, n_visible)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


AttentionInterface.register(TAP_IMPLEMENTATION, _tap_attention)
AttentionMaskInterface.register(TAP_IMPLEMENTATION, sdpa_mask)


@contextlib.contextmanager
def attention_tap(model, tap: AttentionTap):
    """Route ``model``'s attention through ``tap`` inside the block; restore it on exit.

    Works for any model that dispatches through ``AttentionInterface`` (``set_attn_implementation``).
    """
    previous = model.config._attn_implementation
    token = _ACTIVE.set(tap)
    model.set_attn_implementation(TAP_IMPLEMENTATION)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
        _ACTIVE.reset(token)
