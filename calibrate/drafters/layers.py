"""Building blocks of the drafters' own modules (EAGLE-3, DFlash): Llama-style norm, MLP, RoPE, attention.

Written to match transformers' Llama / Qwen3 code numerically (the same order of operations and
precisions), so a drafter built from these pieces reproduces the reference implementations it was
checked against (``docs/drafters.md``).

RoPE is rotate-half (Llama): pairs ``(i, i + D/2)`` are rotated by ``position * inv_freq[i]`` with
``inv_freq[i] = theta^(-2i/D)``. Position-interpolation variants change ``inv_freq`` or the
positions: :func:`rope_cos_sin` is the one place they are applied (``linear``: positions divided
by the factor, as ``rope_scaling = {"type": "linear"}`` asks), and :func:`rope_factor` the one
place that reads ``rope_scaling`` from a ``config.json``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError

__all__ = ["RMSNorm", "GatedMLP", "rope_factor", "rope_inv_freq", "rope_cos_sin", "apply_rope", "repeat_kv",
           "attention"]

ROPE_SCALINGS = ("linear",)  # rope_scaling types rope_cos_sin implements


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


def rope_factor(config: dict, where: str, what: str) -> float:
    """The linear RoPE scaling factor of a ``config.json`` (1.0 without ``rope_scaling``).

    Any other ``rope_scaling`` type is a one-line ``UserError`` naming it.
    """
    scaling = config.get("rope_scaling")
    if not scaling:
        return 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ROPE_SCALINGS:
        raise UserError(f"{where}: rope_scaling type {kind!r} is not supported for {what} "
                        f"(only {', '.join(map(repr, ROPE_SCALINGS))} or none)")
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise UserError(f"{where}: rope_scaling factor should be a positive number, got {factor!r}")
    return float(factor)


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """Rotation frequencies (head_dim / 2,) in fp32: ``theta^(-2i/D)``."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 linear_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (B, 1, T, head_dim) for rotate-half RoPE at ``position_ids`` (B, T), in fp32.

    ``linear_factor`` divides the positions (linear position interpolation, :func:`rope_factor`).
    """
    inv_freq = rope_inv_freq(head_dim, theta, position_ids.device)
    freqs = (position_ids.float() / linear_factor)[..., None] * inv_freq  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, D) rotated by (cos, sin) of shape (B, 1, T, D)."""
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
    PyTorch's fused kernel with the same mask.
    """
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if implementation == "sdpa":
        return F.scaled_dot_product_attention(query, key, value, attn_mask=visible, scale=scaling)
    logits = torch.matmul(query, key.transpose(-1, -2)) * scaling  # (B, heads, q, k)
    if visible is not None:
        logits = logits.masked_fill(~visible, torch.finfo(logits.dtype).min)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value)
