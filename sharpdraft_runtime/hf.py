"""transformers integration: a ``sharpdraft`` attention function that scales queries, then attends.

Models that dispatch attention through transformers' ``AttentionInterface`` (Llama, Qwen, PARD
drafters, and calibrate's DFlash drafter, whose config is its own dataclass) call
``fn(module, query, key, value, attention_mask, dropout, scaling, **kwargs)`` with post-RoPE queries ``(batch, heads, q_len, head_dim)`` and post-cache keys
``(batch, kv_heads, k_len, head_dim)``. :func:`enable` registers :func:`sharpdraft_attention`
under the name ``"sharpdraft"``, together with a mask function of the same name (transformers
gives an unknown name no mask at all, which would break padding), and switches the model to it.
The function wraps the implementation the model used before (``sdpa`` or ``eager``): it counts
the keys each query row sees, scales the query by ``alpha(n)`` (:mod:`sharpdraft_runtime.core`),
and calls the wrapped implementation with everything else unchanged.

Counting visible keys is :func:`~sharpdraft_runtime.visible.visible_keys` for the wrapped kernel:
the keys a 4D mask allows (padding, sliding windows, cached prefill, draft blocks; counted in each
layer with two narrow reductions over the mask, and nothing kept between layers, so no byte
outlives the layer's own temporaries); without a mask, sdpa's causal path (upper-left aligned,
``n_i = i + 1``) when causal with ``q_len > 1``, and otherwise every key (decoding one token,
non-causal blocks such as DFlash's, eager attention).

A spec with a ``window`` (and ``sinks``) restricts the mask itself: the registered mask function
ands the window rule into the mask transformers builds once per forward
(:func:`restrict_mask_kwargs`), so the kernel attends, and the count counts, only the keys kept.

When every row sees one number of keys and the spec has no per-head slopes, ``alpha`` is folded
into ``scaling`` instead (no tensor op at all); when ``k_len`` is within the spec's identity limit
the wrapped implementation is called untouched.

A spec with ``positions`` (a distance fix: clamp, group or pi) computes the call's logits at
remapped RoPE positions (:func:`positions_attention`, :mod:`sharpdraft_runtime.positions`) with the
rotation frequencies of the model's own rotary embedding (:func:`model_inv_freq`, read once by
:func:`enable`; RoPE types whose frequencies change with the length, such as ``dynamic`` and
``longrope``, are refused by name). Keys must sit at their cache slots (unpadded causal sequences,
``position_ids`` = slots); calls within the fix's identity limit run the wrapped kernel untouched.
The layers of one forward share what is the same for all of them (a decoding step's rotation table,
the check of ``position_ids``) through a dict that two forward hooks on the model open and drop.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass, field

import torch
from sharpdraft_theory import ScaleSpec
from transformers import AttentionInterface
from transformers.masking_utils import (ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, and_masks,
                                       causal_mask_function)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .core import QueryScaler
from .positions import at_slots, attention_at, decode_attention, decode_keys, identity_at, remapped_attention
from .visible import IMPLEMENTATIONS, first_key, visible_keys, window_overlay

__all__ = ["NAME", "WRAPPABLE", "REMAPPABLE_ROPE", "enable", "disable", "is_enabled", "sharpdraft_attention",
           "sharpdraft_mask", "restrict_mask_kwargs", "model_inv_freq", "positions_attention"]

NAME = "sharpdraft"
WRAPPABLE = IMPLEMENTATIONS  # the implementations whose visible keys visible_keys counts
# RoPE types whose inv_freq is fixed, so a post-RoPE tensor can be re-rotated exactly (yarn's attention
# factor multiplies cos and sin alike and survives a rotation)
REMAPPABLE_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass
class _Binding:
    """What one enabled model needs at call time."""

    spec: ScaleSpec  # the spec applied
    wrapped: str  # the implementation wrapped (sdpa or eager), restored on disable
    scalers: dict = field(default_factory=dict)  # device -> QueryScaler
    inv_freq: torch.Tensor | None = None  # the model's RoPE frequencies, for a spec with positions; else None
    tables: dict | None = None  # during a forward of a model with positions: what its layers share (one step)
    hooks: list = field(default_factory=list)  # the forward hooks that open and drop ``tables``

    def scaler(self, device: torch.device) -> QueryScaler:
        if device not in self.scalers:
            self.scalers[device] = QueryScaler(self.spec, device)
        return self.scalers[device]


_BINDINGS: dict[int, _Binding] = {}  # id(config) -> binding; configs are not hashable
_EAGER: dict[type, object] = {}  # attention module class -> the eager function of its modeling file
_EAGER_NAMES = ("eager_attention_forward", "eager_attention")  # transformers' convention, then calibrate's DFlash


def _binding(config) -> _Binding:
    binding = _BINDINGS.get(id(config))
    if binding is None:
        raise RuntimeError(f"attention implementation {NAME!r} is set but no spec is bound to this model: "
                           "call sharpdraft_runtime.enable(model, spec)")
    return binding


def _attention_fn(binding: _Binding, module: torch.nn.Module):
    if binding.wrapped != "eager":
        return ALL_ATTENTION_FUNCTIONS[binding.wrapped]
    cls = type(module)
    if cls not in _EAGER:
        found = [getattr(sys.modules[cls.__module__], name, None) for name in _EAGER_NAMES]
        if not any(found):
            raise RuntimeError(f"{cls.__name__} has no {' or '.join(_EAGER_NAMES)} beside it to wrap; "
                               "use attn_implementation='sdpa'")
        _EAGER[cls] = next(fn for fn in found if fn is not None)
    return _EAGER[cls]


def sharpdraft_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         **kwargs):
    """transformers attention function: scale ``query`` by ``alpha(n_visible)``, then attend.

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer (``module.config`` bound by :func:`enable`; ``module.layer_idx`` used by
        per-layer and per-head specs).
    query : Tensor of shape (batch, heads, q_len, head_dim)
        Post-RoPE queries; scaled in place under no-grad / inference mode.
    key, value : Tensor of shape (batch, kv_heads, k_len, head_dim)
        Post-RoPE, post-cache keys and values.
    attention_mask : Tensor of shape (batch, 1 or heads, q_len, k_len) or None
        The mask made by the wrapped implementation's mask function.
    dropout, scaling, **kwargs
        Passed to the wrapped implementation (``scaling=None``: ``head_dim ** -0.5``).

    Returns
    -------
    attn_output : Tensor of shape (batch, q_len, heads, head_dim)
    attn_weights : Tensor of shape (batch, heads, q_len, k_len) or None
        Whatever the wrapped implementation returns.
    """
    binding = _binding(module.config)
    attend = _attention_fn(binding, module)
    k_len = key.shape[-2]
    spec = binding.spec
    if attention_mask is None and spec.restricts() and k_len > spec.window + (spec.sinks or 0):
        raise ValueError(f"the spec's window ({spec.window}) restricts causal attention through its mask; this call "
                         f"has no mask (a non-causal block), so its {k_len} keys cannot be restricted")
    scaler = binding.scaler(query.device)
    if k_len > scaler.identity_limit:
        layer = getattr(module, "layer_idx", None)
        n = visible_keys(query, key, attention_mask, is_causal=kwargs.get("is_causal"), module=module,
                         implementation=binding.wrapped)
        if isinstance(n, int) and binding.spec.granularity != "head":
            scaling = (scaling if scaling is not None else query.shape[-1] ** -0.5) * scaler.host_alpha(n, layer)
        else:
            query = scaler.scale_query_(query, n, layer)
    if binding.inv_freq is not None:
        out = positions_attention(module, query, key, value, attention_mask, scaling, spec, binding.inv_freq, attend,
                                  dropout=dropout, shared=binding.tables, **kwargs)
        if out is not None:
            return out
    return attend(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def model_inv_freq(model) -> torch.Tensor:
    """The RoPE frequencies (head_dim / 2,) of ``model``'s rotary embedding, for re-rotating its queries and keys.

    A ``ValueError`` naming the reason when the model has none, several that differ (per layer type),
    a RoPE type outside :data:`REMAPPABLE_ROPE` (``dynamic``, ``longrope``, ... change the frequencies
    with the length), or partial rotary dimensions. The rotation is rotate-half (Llama's layout).
    """
    found = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    if not found:
        raise ValueError(f"{type(model).__name__} has no rotary embedding (a module with inv_freq): position fixes "
                         "re-rotate RoPE queries and keys")
    for module in found:
        rope_type = getattr(module, "rope_type", "default")
        if rope_type not in REMAPPABLE_ROPE:
            raise ValueError(f"rope type {rope_type!r} is not supported for position fixes (its frequencies change "
                             f"with the length); supported: {', '.join(REMAPPABLE_ROPE)}")
    inv_freq = found[0].inv_freq.detach().float()
    if any(m.inv_freq.shape != inv_freq.shape or not torch.equal(m.inv_freq.detach().float(), inv_freq)
           for m in found[1:]):
        raise ValueError(f"{type(model).__name__} has several RoPE frequencies (per layer type); position fixes "
                         "support one RoPE for all layers")
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if 2 * inv_freq.numel() != head_dim:
        raise ValueError(f"the rotary embedding covers {2 * inv_freq.numel()} of {head_dim} head dimensions "
                         "(partial rotary): not supported for position fixes")
    return inv_freq.clone()


def positions_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None, spec: ScaleSpec,
                        inv_freq: torch.Tensor, attend, dropout: float = 0.0, shared: dict | None = None,
                        **kwargs) -> tuple | None:
    """Attention of one transformers call at the spec's remapped positions, as a kernel returns it
    (output (batch, q_len, heads, head_dim), weights or None); None when the call is within the fix's
    identity limit (the caller's kernel runs instead).

    A call that names its positions (keyword arguments ``query_positions`` and ``key_positions``, 1-D, as a
    DFlash block does: its context keys then its own, some after its rows) runs
    :func:`~sharpdraft_runtime.positions.attention_at` with its bool mask (None: every key visible).
    Otherwise queries sit at positions ``k_len - q_len ..`` and keys at their cache slots; ``position_ids``, when
    the model passes them, must say so (a ``ValueError`` otherwise: left padding or packed sequences).
    A decoding step (``q_len = 1``) whose kernel is plain attention (transformers' sdpa, no dropout, position
    bias or softcap, a bool mask or none: :func:`_plain_sdpa`) runs
    :func:`~sharpdraft_runtime.positions.decode_attention` (on the CPU in float32 the far keys rotated inside
    the logits' compiled pass); any other is ``attend``, the wrapped kernel, over the keys of
    :func:`~sharpdraft_runtime.positions.decode_keys` with everything else as the call gave it (a model's own
    eager function may carry terms of its own, sink logits say, that plain attention would drop); more rows
    run :func:`~sharpdraft_runtime.positions.remapped_attention`, the mask the call received selecting
    the keys (none: causal by position). A call without a mask that is not causal (a draft block) is refused.
    ``shared``: a dict the layers of one forward share (the decoding step's rotation table, the
    ``position_ids`` already checked), dropped by the caller when the forward returns; None: nothing shared.
    """
    q_len, k_len = query.shape[2], key.shape[2]
    fix = spec.positions
    k_pos = kwargs.get("key_positions")
    if k_pos is not None:  # keys named by position, not at their slots (DFlash blocks)
        return _attention_at(query, key, value, attention_mask, scaling, fix, inv_freq, kwargs["query_positions"], k_pos)
    if k_len <= fix.identity_limit:
        return None
    if attention_mask is None and not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise ValueError(f"the spec's positions ({fix.fix}) remap causal attention; this call is a non-causal block "
                         "without a mask")
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and (shared is None or shared.get("position_ids") is not position_ids):
        if not at_slots(position_ids, k_len):
            raise ValueError(f"the spec's positions ({fix.fix}) need each key at its cache slot (unpadded sequences); "
                             "this call's position_ids differ")
        if shared is not None:
            shared["position_ids"] = position_ids  # the same tensor reaches every layer of the forward
    inv_freq = inv_freq.to(query.device)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5  # what the wrapped kernel defaults to
    if q_len == 1:
        if not _plain_sdpa(attend, attention_mask, dropout, kwargs):
            return attend(module, query, decode_keys(key, fix, inv_freq, shared), value, attention_mask,
                          dropout=dropout, scaling=scaling, **kwargs)

        def kernel(q, k, v):  # the wrapped sdpa as the call gave it, (B, H, 1, D)
            return attend(module, q, k, v, attention_mask, dropout=dropout, scaling=scaling, **kwargs)[0].transpose(1, 2)

        visible = None if attention_mask is None else attention_mask[..., :k_len]
        out = decode_attention(query, key, value, scale, fix, inv_freq, kernel, visible, shared)
        return out.transpose(1, 2).contiguous(), None
    visible = None
    if attention_mask is not None:
        mask = attention_mask[..., :k_len]
        visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
    out = remapped_attention(query, key, value, scale, fix, inv_freq, visible)
    return out.transpose(1, 2).contiguous(), None  # (B, q_len, H, D), as transformers' kernels return


def _plain_sdpa(attend, attention_mask, dropout: float, kwargs: dict) -> bool:
    """Whether ``attend`` with these arguments is plain attention, ``softmax(q k^T scaling + mask) v``: transformers'
    sdpa function without dropout, a position bias or a softcap, with a bool mask or none. Only then may
    :func:`~sharpdraft_runtime.positions.decode_attention` stand in for it (a model's own eager function may add
    terms, sink logits say, that the runtime does not know)."""
    return (attend is ALL_ATTENTION_FUNCTIONS["sdpa"] and not dropout and kwargs.get("position_bias") is None
            and kwargs.get("softcap") is None and (attention_mask is None or attention_mask.dtype == torch.bool))


def _attention_at(query, key, value, attention_mask, scaling, fix, inv_freq, q_pos, k_pos) -> tuple | None:
    """:func:`positions_attention` for a call that names its queries' and keys' positions (``query_positions``
    (q_len,), ``key_positions`` (k_len,)): None when every pair keeps its positions, else
    :func:`~sharpdraft_runtime.positions.attention_at` with the call's bool mask (None: every key visible)."""
    if identity_at(fix, q_pos, k_pos):
        return None
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise ValueError("attention with named key positions takes a bool mask (True where visible)")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = attention_at(query, key, value, scaling, fix, inv_freq.to(query.device), q_pos, k_pos, attention_mask)
    return out.transpose(1, 2).contiguous(), None


def restrict_mask_kwargs(spec: ScaleSpec | None, kwargs: dict) -> dict:
    """The keyword arguments of a transformers mask function, with the spec's window and sinks and-ed in.

    transformers builds a model's 4D mask once per forward from ``mask_function`` (causal, sliding
    window, ...) and the 2D padding ``attention_mask``; the window and sinks rule
    (:func:`~sharpdraft_runtime.visible.window_overlay`, sinks counted from each row's first real
    key) joins ``mask_function``, so the mask the attention calls receive is the restricted one and
    nothing else is allocated. sdpa may skip a causal mask (``is_causal``) when nothing is padded;
    with a window it must not, so the skip is turned off. A spec without a window changes nothing.
    """
    if spec is None or not spec.restricts():
        return kwargs
    overlay = window_overlay(spec.window, spec.sinks, first_key(kwargs.get("attention_mask")))
    return {**kwargs, "mask_function": and_masks(kwargs.get("mask_function", causal_mask_function), overlay),
            "allow_is_causal_skip": False}


def sharpdraft_mask(*args, config=None, **kwargs):
    """transformers mask function: the mask of the implementation :func:`sharpdraft_attention` wraps,
    restricted to the spec's window and sinks (:func:`restrict_mask_kwargs`)."""
    binding = _binding(config)
    return ALL_MASK_ATTENTION_FUNCTIONS[binding.wrapped](*args, config=config,
                                                         **restrict_mask_kwargs(binding.spec, kwargs))


def _configs(model: torch.nn.Module) -> dict[int, object]:
    """Every config the model's modules read their attention implementation from."""
    found = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if hasattr(config, "_attn_implementation"):
            found[id(config)] = config
    return found


def _check_shape(spec: ScaleSpec, config) -> None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    spec.check_fits(text.num_hidden_layers, text.num_attention_heads)


def enable(model, spec: ScaleSpec):
    """Apply ``spec`` to every attention layer of a transformers model, in place.

    Registers the ``"sharpdraft"`` attention and mask functions, binds ``spec`` to the model and
    switches it to them; calling it again replaces the spec.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A model whose attention dispatches through ``AttentionInterface`` and currently uses
        ``sdpa`` or ``eager`` attention.
    spec : ScaleSpec
        The scale spec; per-layer and per-head slopes, and the drafter it records being made for,
        must match the model's layers and heads (a ``ValueError`` naming both otherwise). With
        ``positions``, the model's RoPE must be one :func:`model_inv_freq` can re-rotate.

    Returns
    -------
    The same model.

    Notes
    -----
    Queries are scaled in place: run the model under ``torch.inference_mode()`` or
    ``torch.no_grad()``. With grad enabled the query is scaled out of place instead.
    """
    config = model.config
    if getattr(model, "block_drafter", False) and (spec.restricts() or spec.positions is not None):
        raise ValueError(f"{type(model).__name__} drafts non-causal blocks, whose window and positions this runtime "
                         "applies through the mask a causal model builds: enable a scale-only spec on it, or run "
                         "calibrate.drafters.blocks.DFlashBlockProposer, which cuts the block's context itself")
    previous = _BINDINGS[id(config)].wrapped if is_enabled(model) else config._attn_implementation
    if previous not in WRAPPABLE:
        raise ValueError(f"{NAME} wraps {' or '.join(WRAPPABLE)} attention, the model uses {previous!r}: "
                         f"load it with attn_implementation='sdpa'")
    _check_shape(spec, config)
    inv_freq = None if spec.positions is None else model_inv_freq(model)
    AttentionInterface.register(NAME, sharpdraft_attention)
    AttentionMaskInterface.register(NAME, sharpdraft_mask)
    if is_enabled(model):
        _drop_hooks(_BINDINGS[id(config)])
    binding = _Binding(spec=spec, wrapped=previous, inv_freq=inv_freq)
    if inv_freq is not None:
        binding.hooks = _share_per_forward(model, binding)
    for key, bound in _configs(model).items():
        if key not in _BINDINGS:
            weakref.finalize(bound, _BINDINGS.pop, key, None)
        _BINDINGS[key] = binding
    model.set_attn_implementation(NAME)
    if config._attn_implementation != NAME:
        disable(model)
        raise ValueError(f"{type(model).__name__} cannot switch its attention implementation at run time")
    return model


def disable(model):
    """Restore the attention implementation the model had before :func:`enable`; returns the model."""
    if not is_enabled(model):
        raise ValueError(f"{NAME} is not enabled on this model")
    binding = _BINDINGS[id(model.config)]
    model.set_attn_implementation(binding.wrapped)
    _drop_hooks(binding)
    for key in _configs(model):
        _BINDINGS.pop(key, None)
    return model


def _share_per_forward(model: torch.nn.Module, binding: _Binding) -> list:
    """Hooks that give the layers of each forward of ``model`` one dict to share (``binding.tables``: a
    decoding step's rotation table is the same in every layer) and drop it when the forward ends, raised
    or not: nothing outlives the forward."""
    def open_(module, args):
        binding.tables = {}

    def drop(module, args, output):
        binding.tables = None

    return [model.register_forward_pre_hook(open_), model.register_forward_hook(drop, always_call=True)]


def _drop_hooks(binding: _Binding) -> None:
    for hook in binding.hooks:
        hook.remove()
    binding.hooks, binding.tables = [], None


def is_enabled(model) -> bool:
    """Whether :func:`enable` has bound a spec to ``model``."""
    return id(model.config) in _BINDINGS
