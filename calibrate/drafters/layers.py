"""Building blocks of the drafters' own modules (EAGLE-3, DFlash): Llama-style norm, MLP, RoPE, attention.

Written to match transformers' Llama / Qwen3 code numerically (the same order of operations and
precisions), so a drafter built from these pieces reproduces the reference implementations it was
checked against (``docs/drafters.md``).

RoPE is rotate-half (Llama): pairs ``(i, i + D/2)`` are rotated by ``position * inv_freq[i]`` with
``inv_freq[i] = theta^(-2i/D)``. Scaled variants (``linear``, ``llama3``, ``yarn``) change
``inv_freq`` and may multiply cos and sin by an attention factor: :func:`read_rope` is the one
place that reads RoPE from a ``config.json`` (either transformers spelling), and
:func:`rope_cos_sin` the one place the variants are applied, with transformers' own functions.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError

__all__ = ["RMSNorm", "GatedMLP", "RopeScaling", "ROPE_SCALINGS", "read_rope", "read_partial_rotary", "rotary_dim",
           "rope_inv_freq", "rope_cos_sin",
           "apply_rope", "repeat_kv", "attention"]


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, cast back, then scale (the order EAGLE and transformers use)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency scaling read from ``config.json`` (:func:`read_rope`), computed by transformers.

    The inverse frequencies and the attention factor ``a`` come from transformers' own
    ``ROPE_INIT_FUNCTIONS[rope_type]`` (``modeling_rope_utils``), so they equal what the reference
    models compute. ``a`` multiplies cos and sin, as transformers' rotary embeddings do: post-RoPE
    queries and keys are each ``a`` times larger, and every logit ``a^2`` times.
    """

    rope_type: str  # one of ROPE_SCALINGS
    params: tuple[tuple[str, float | bool], ...]  # the type's parameters (factor, ...), sorted by name

    def to_dict(self) -> dict:
        """The ``rope_scaling`` object of a ``config.json`` (transformers 4 spelling)."""
        return {"rope_type": self.rope_type, **dict(self.params)}


# rope types rope_cos_sin implements, and the parameters each reads (others are refused by read_rope)
ROPE_SCALINGS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
             "mscale", "mscale_all_dim", "truncate"),
}
_ROPE_REQUIRED = {"linear": ("factor",), "llama3": ROPE_SCALINGS["llama3"],
                  "yarn": ("factor", "original_max_position_embeddings")}
_ROPE_REFUSED = {
    "mrope": "multimodal RoPE, which this drafter's reference code does not have",
    "dynamic": "dynamic NTK scaling changes the frequencies with the sequence length at run time",
    "longrope": "LongRoPE switches between short and long per-dimension factors with the sequence length",
}
_ROPE_HARMLESS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")  # handled apart from the params


def read_rope(config: dict, where: str, what: str, *, mrope: bool = True) -> tuple[float, RopeScaling | None]:
    """``(theta, scaling)`` of a ``config.json``, in either spelling transformers reads.

    transformers 4: ``rope_theta`` (default 10000) and ``rope_scaling`` ``{rope_type | type, ...}``;
    transformers 5: ``rope_parameters`` ``{rope_type, rope_theta, ...}``, possibly one per layer type
    (accepted when all are equal). Both may be present (SpecForge writes both); they must agree.
    ``mrope`` with text positions (all three streams equal) is plain RoPE and returns no scaling
    (with ``mrope`` false, for drafters whose reference code has no multimodal RoPE, it is refused).
    Refused with a one-line ``UserError``: an unknown or run-time-dependent type (``dynamic``,
    ``longrope``), a parameter the type does not read, and ``llama3`` / ``yarn``
    without ``original_max_position_embeddings``, which transformers
    would take from ``max_position_embeddings`` (in drafter configs often the target's context, not
    the length the frequencies were designed for).
    """
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        distinct = {json.dumps(v, sort_keys=True) for v in params.values()}
        if len(distinct) > 1:
            raise UserError(f"{where}: rope_parameters differ per layer type ({', '.join(params)}); {what} "
                            f"supports one RoPE for all layers")
        params = next(iter(params.values()))
    legacy = config.get("rope_scaling") or {}
    for name, value in (("rope_scaling", legacy), ("rope_parameters", params or {})):
        if not isinstance(value, dict):
            raise UserError(f"{where}: {name} should be an object such as {{\"rope_type\": \"linear\", "
                            f"\"factor\": 2.0}}, got {value!r}")
    theta = config.get("rope_theta")
    if params:
        if theta is not None and params.get("rope_theta", theta) != theta:
            raise UserError(f"{where}: rope_theta {theta} and rope_parameters.rope_theta "
                            f"{params['rope_theta']} disagree")
        theta = params.get("rope_theta", theta)
        other = {k: v for k, v in legacy.items() if k != "type"}
        if other and any(params.get(k) != v for k, v in other.items()):
            raise UserError(f"{where}: rope_scaling {legacy!r} and rope_parameters {params!r} disagree")
    else:
        params = legacy
    theta = 10000.0 if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 1:
        raise UserError(f"{where}: rope_theta should be a number above 1, got {theta!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if "type" in params and params["type"] != kind:
        raise UserError(f"{where}: rope type {params['type']!r} and rope_type {kind!r} disagree")
    if kind == "default":
        extra = sorted(set(params) - set(_ROPE_HARMLESS))
        if extra:
            raise UserError(f"{where}: RoPE parameter {extra[0]!r} has no meaning for default RoPE; remove it")
        return float(theta), None
    if kind == "mrope" and mrope:
        # Multimodal RoPE takes each section of the rotary dimensions from one of three position streams
        # (time, height, width); for text tokens all three are the token's position (Qwen2-VL's get_rope_index),
        # so on the text calibration and eval run it is plain RoPE (SpecForge apply_multimodal_rotary_pos_emb).
        section = params.get("mrope_section")
        extra = sorted(set(params) - {"mrope_section", *_ROPE_HARMLESS})
        if extra or not isinstance(section, list) or len(section) != 3 or not all(
                isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in section):
            raise UserError(f"{where}: mrope needs mrope_section, three positive integers, and nothing else"
                            + (f" (got {extra[0]!r})" if extra else f", got {section!r}"))
        return float(theta), None
    if kind in _ROPE_REFUSED:
        raise UserError(f"{where}: rope type {kind!r} is not supported for {what}: {_ROPE_REFUSED[kind]}")
    if kind not in ROPE_SCALINGS:
        raise UserError(f"{where}: rope type {kind!r} is not supported for {what} "
                        f"(only default, {', '.join(ROPE_SCALINGS)})")
    unknown = sorted(set(params) - set(ROPE_SCALINGS[kind]) - set(_ROPE_HARMLESS))
    if unknown:
        raise UserError(f"{where}: RoPE parameter {unknown[0]!r} is not read for rope type {kind!r}; "
                        f"refusing rather than ignoring it")
    for name in _ROPE_REQUIRED[kind]:
        if params.get(name) is None:
            hint = (f"; transformers would use max_position_embeddings ({config.get('max_position_embeddings')}), "
                    f"which is not the length the frequencies were designed for" if name.startswith("original") else "")
            raise UserError(f"{where}: rope type {kind!r} needs '{name}'{hint}")
    values = {k: v for k, v in params.items() if k in ROPE_SCALINGS[kind] and v is not None}
    for name, value in values.items():
        if name != "truncate" and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise UserError(f"{where}: RoPE parameter '{name}' should be a positive number, got {value!r}")
    return float(theta), RopeScaling(kind, tuple(sorted(values.items())))


class _RopeView:
    """The attributes transformers' rope init functions read from a config."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling):
        self.head_dim = head_dim
        self.hidden_size, self.num_attention_heads = head_dim, 1  # read (eagerly) as a fallback head_dim
        self.rope_parameters = {"rope_type": scaling.rope_type, "rope_theta": theta, **dict(scaling.params)}

    def standardize_rope_params(self) -> None:
        """Already standard."""


@functools.lru_cache(maxsize=64)
def _scaled_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, factor = ROPE_INIT_FUNCTIONS[scaling.rope_type](_RopeView(head_dim, theta, scaling), torch.device("cpu"))
    return inv_freq.float(), float(factor)


def read_partial_rotary(config: dict, where: str) -> float:
    """The fraction of each head's dimensions RoPE rotates, from every spelling of ``partial_rotary_factor``.

    Top level (transformers 4), inside ``rope_parameters`` (transformers 5, also per layer type) or
    inside ``rope_scaling``; all that are present must agree. 1.0 when none is (the whole head).
    """
    params = config.get("rope_parameters")
    sections = [("", config), ("rope_scaling.", config.get("rope_scaling"))]
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        sections += [(f"rope_parameters.{k}.", v) for k, v in params.items()]
    else:
        sections.append(("rope_parameters.", params))
    found = {name + "partial_rotary_factor": s["partial_rotary_factor"] for name, s in sections
             if isinstance(s, dict) and s.get("partial_rotary_factor") is not None}
    for name, value in found.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise UserError(f"{where}: {name} should be a number in (0, 1], got {value!r}")
    if len(set(found.values())) > 1:
        raise UserError(f"{where}: partial_rotary_factor disagrees between spellings ({found}); which applies is unclear")
    return float(next(iter(found.values()), 1.0))


def rotary_dim(head_dim: int, partial_rotary_factor: float, where: str) -> int:
    """Dimensions RoPE rotates: ``int(head_dim * factor)`` as vLLM's and SGLang's ``get_rope`` and transformers
    compute it; it must be even and positive (rotate-half pairs ``i`` with ``i + rotary_dim / 2``)."""
    dim = int(head_dim * partial_rotary_factor)
    if dim <= 0 or dim % 2:
        raise UserError(f"{where}: partial_rotary_factor {partial_rotary_factor} of head_dim {head_dim} gives "
                        f"{dim} rotary dimensions; expected a positive even number")
    return dim


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                  device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """Rotation frequencies (head_dim / 2,) in fp32 and the attention factor ``a``.

    Without ``scaling``: ``theta^(-2i/D)`` and ``a = 1``; with it, transformers' values (:class:`RopeScaling`).
    """
    if scaling is None:
        return 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim), 1.0
    inv_freq, factor = _scaled_inv_freq(head_dim, theta, scaling)
    return inv_freq.to(device), factor


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: RopeScaling | None = None, frequencies: tuple[torch.Tensor, float] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``a cos``, ``a sin`` of shape (B, 1, T, head_dim) for rotate-half RoPE at ``position_ids`` (B, T).

    ``head_dim`` is the rotated width: the whole head, or :func:`rotary_dim` with a partial factor
    (then :func:`apply_rope` leaves the remaining dimensions as they are). Computed in fp32 and cast
    to ``dtype``, in transformers' order (``a``: :func:`rope_inv_freq`; ``frequencies``: its result when the
    caller already has it).
    """
    inv_freq, factor = frequencies or rope_inv_freq(head_dim, theta, scaling, position_ids.device)
    freqs = position_ids.float()[..., None] * inv_freq  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, D)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, D) rotated by (cos, sin) of shape (B, 1, T, R), R <= D: the first R dimensions are
    rotated (rotate-half within them, vLLM's neox style), the other D - R pass through (partial rotary)."""
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, kv_heads, T, D) -> (B, kv_heads * groups, T, D); head h reads kv head h // groups."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
              visible: torch.Tensor | None, implementation: str = "sdpa") -> torch.Tensor:
    """softmax(query key^T * scaling + mask) value, GQA-aware; returns (B, heads, q, D).

    ``visible`` is a bool mask broadcastable to (B, heads, q, k) or None (all keys visible).
    ``"eager"`` is the plain-math path (fp32 softmax, as EAGLE computes it); ``"sdpa"`` calls
    PyTorch's kernel with the same mask (on CPU, or without a mask, each key head read in place by its
    query heads; otherwise the keys and values repeated per query head, as the eager path does).
    """
    groups = query.shape[1] // key.shape[1]
    if implementation == "sdpa" and (visible is None or query.device.type == "cpu"):
        # GQA in the kernel, each key head read in place (CUDA's fused kernels take it without a mask only)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scaling,
                                              enable_gqa=groups > 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if implementation == "sdpa":
        return F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scaling)
    logits = torch.matmul(query, key.transpose(-1, -2)) * scaling  # (B, heads, q, k)
    if visible is not None:
        logits = logits.masked_fill(~visible, torch.finfo(logits.dtype).min)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value)
