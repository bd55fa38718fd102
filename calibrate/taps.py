"""Attention taps for transformers models: see post-RoPE queries and keys, and scale the queries.

transformers dispatches every attention call of a modern model through ``AttentionInterface``
(``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``) with the post-RoPE ``query``
(batch, heads, q_len, head_dim) and ``key`` (batch, kv_heads, k_len, head_dim). We register one
function, ``"sharpdraft-tap"``, that hands them to the active tap, with the keys each query row
sees (:func:`sharpdraft_runtime.visible_keys`, the count the runtime scales by), and then runs
transformers' own ``sdpa_attention_forward``. A tap that returns nothing leaves the model's
outputs those of ``attn_implementation="sdpa"`` bit for bit; one that returns a query (query
scaling, :class:`ScalingTap`) has it attended instead. The same name is registered with
``AttentionMaskInterface`` (sdpa's mask builder): an implementation without a mask function gets
``attention_mask=None``, which would silently drop padding masks. See
https://huggingface.co/docs/transformers/attention_interface.

``attention_tap(model, tap, restrict=spec)`` switches a model to the tap for the duration of a
``with`` block and restores its previous implementation afterwards; a spec with a ``window`` (and
``sinks``) restricts the mask as the runtime does (``sharpdraft_runtime.hf.restrict_mask_kwargs``), and one
with ``positions`` attends at the remapped positions as the runtime does
(``sharpdraft_runtime.hf.positions_attention``). hf, pard and DFlash drafters use it; the
EAGLE-3 head calls the same kind of tap from its own attention.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from sharpdraft_runtime import query_hook, visible_keys
from sharpdraft_runtime.hf import model_inv_freq, positions_attention, restrict_mask_kwargs
from sharpdraft_theory import ScaleSpec

from .drafters.base import AttentionTap

__all__ = ["TAP_IMPLEMENTATION", "attention_tap", "ScalingTap"]

TAP_IMPLEMENTATION = "sharpdraft-tap"
_ACTIVE: contextvars.ContextVar[AttentionTap | None] = contextvars.ContextVar("sharpdraft_tap", default=None)
_RESTRICT: contextvars.ContextVar[ScaleSpec | None] = contextvars.ContextVar("sharpdraft_tap_restrict", default=None)
_INV_FREQ: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("sharpdraft_tap_rope", default=None)


def _rows(n: int | torch.Tensor, batch: int, q_len: int, device: torch.device) -> torch.LongTensor:
    """``visible_keys``'s count as the tap's (batch, q_len); taps read one count per query row."""
    n = torch.as_tensor(n, device=device)
    if n.ndim == 3:
        if n.shape[1] != 1:
            raise ValueError("attention taps take one visible-key count per query row; this call has a per-head mask")
        n = n[:, 0]
    return n.expand(batch, q_len).long()


def _tap_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs):
    tap = _ACTIVE.get()
    if tap is not None:
        n = visible_keys(query, key, attention_mask, is_causal=kwargs.get("is_causal"), module=module)
        batch, _, q_len, _ = query.shape
        replaced = tap(module.layer_idx, query, key, query.shape[-1] ** -0.5 if scaling is None else scaling,
                       _rows(n, batch, q_len, query.device))
        query = query if replaced is None else replaced
    restrict, inv_freq = _RESTRICT.get(), _INV_FREQ.get()
    if inv_freq is not None:
        out = positions_attention(module, query, key, value, attention_mask, scaling, restrict, inv_freq,
                                  sdpa_attention_forward, dropout=dropout, **kwargs)
        if out is not None:
            return out
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _tap_mask(*args, **kwargs):
    return sdpa_mask(*args, **restrict_mask_kwargs(_RESTRICT.get(), kwargs))


AttentionInterface.register(TAP_IMPLEMENTATION, _tap_attention)
AttentionMaskInterface.register(TAP_IMPLEMENTATION, _tap_mask)


@contextlib.contextmanager
def attention_tap(model, tap: AttentionTap, restrict: ScaleSpec | None = None, inv_freq: torch.Tensor | None = None):
    """Route ``model``'s attention through ``tap`` inside the block; restore it on exit.

    Works for any model that dispatches through ``AttentionInterface`` (``set_attn_implementation``).
    ``restrict``: a spec whose ``window`` and ``sinks`` restrict the attention, or whose ``positions``
    remap it (None: neither); ``inv_freq``: the RoPE frequencies those positions rotate by (default: the
    model's rotary embedding's, ``model_inv_freq``; a DFlash model gives its own).
    """
    previous = model.config._attn_implementation
    if restrict is None or restrict.positions is None:
        inv_freq = None
    elif inv_freq is None:
        inv_freq = model_inv_freq(model)
    token = _ACTIVE.set(tap)
    restrict_token = _RESTRICT.set(restrict)
    rope_token = _INV_FREQ.set(inv_freq)
    model.set_attn_implementation(TAP_IMPLEMENTATION)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
        _ACTIVE.reset(token)
        _RESTRICT.reset(restrict_token)
        _INV_FREQ.reset(rope_token)


class ScalingTap:
    """A tap that scales each query by the spec's ``alpha(n)``, then shows the scaled query to ``tap``.

    The scaling is the runtime's own (:func:`sharpdraft_runtime.query_hook`, in place under
    no-grad), with the ``n_visible`` the call carries, so a model run under this tap is the model
    with the spec applied, and ``tap`` measures the queries that really attend. ``spec=None``
    scales nothing. ``n_visible`` keeps the counts of the last call to layer 0: the visible keys
    of each query row of the run, shape (batch, q_len).
    """

    def __init__(self, spec: ScaleSpec | None, tap: AttentionTap | None = None):
        self.scale = None if spec is None else query_hook(spec)
        self.tap = tap
        self.n_visible: torch.Tensor | None = None

    def __call__(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float,
                 n_visible: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            query = self.scale(layer_idx, query, key, scaling, n_visible)
        if layer_idx == 0:
            self.n_visible = n_visible
        if self.tap is not None:
            self.tap(layer_idx, query, key, scaling, n_visible)
        return query
