"""Distance fixes at inference: attention whose logits are computed at remapped RoPE positions.

A spec's ``positions`` (:class:`sharpdraft_theory.positions.PositionFix`: clamp, group or pi) says at
which positions ``(p_q, p_k)`` the logit of query ``i`` and key ``j`` is computed. The queries and
keys an attention call receives are already rotated at ``i`` and ``j`` (post-RoPE, the model's
``inv_freq`` and, for yarn-like RoPE, an attention factor ``a`` folded into both). A rotation by the
difference gives the remapped one exactly::

    R(p_q - i) (a R(i) q) = a R(p_q) q          (rotations compose; the norm, hence a, is kept)

so :func:`rotate` turns a post-RoPE tensor into the same tensor rotated at the remapped positions,
with the model's own ``inv_freq`` and no knowledge of ``a``. The logits of a row are those of the
neighbour keys (``i - j < W``, unchanged) beside those of the far keys (both sides re-rotated):
:func:`remapped_logits`. :func:`remapped_attention` is softmax over them, the mask and ``scaling``
applied as the plain kernel would, in chunks of query rows so no (q_len x k_len) matrix for all
heads is held at once. A query scaled by ``alpha(n)`` beforehand (``+spec``) scales both kinds of
logits of its row, since rotations are linear.

Cost, only when a fix is set and a call has a key past the fix's identity limit (else the model's own
kernel runs untouched, with nothing allocated): one re-rotation of the keys per group of rows (one
group for clamp and group; one per power of two for pi, a handful), one of the queries, and the
logits as a plain matmul: clamp and group compute two logit matrices (neighbour and far), pi one.
The attention itself runs in eager math (fp32 softmax) instead of a fused kernel, chunked by rows.
"""

from __future__ import annotations

import torch
from sharpdraft_theory.positions import PositionFix

__all__ = ["rotate", "remapped_logits", "remapped_attention", "slot_positions"]

_CHUNK_ELEMENTS = 1 << 24  # logits held at once per chunk of query rows (64 MiB in float32)


def rotate(x: torch.Tensor, shift: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``x`` (B, heads, T, D), rotate-half RoPE, rotated further by ``shift`` (T,) positions.

    The angles ``shift * inv_freq`` are formed in float64 (a shift of thousands of positions keeps
    full precision), then applied in ``x``'s precision (float32 at least). ``inv_freq`` (R/2,) may
    cover only the first ``R < D`` dimensions (partial rotary: the rest are not rotated, as RoPE left
    them). Returns a new tensor.
    """
    angles = shift.to(torch.float64)[:, None] * inv_freq.to(device=shift.device, dtype=torch.float64)  # (T, R/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, R)
    dtype = torch.promote_types(x.dtype, torch.float32)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    width = angles.shape[-1]
    half = width // 2
    y = x.to(dtype)
    r = y[..., :width]  # (B, heads, T, R) the rotated part
    rotated = torch.cat((-r[..., half:], r[..., :half]), dim=-1)
    return torch.cat((r * cos + rotated * sin, y[..., width:]), dim=-1).to(x.dtype)


def slot_positions(q_len: int, k_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of a causal call whose keys sit at their cache slots: queries ``k_len - q_len ..``, keys ``0 ..``."""
    return torch.arange(k_len - q_len, k_len, device=device), torch.arange(k_len, device=device)


def _far_keys(key: torch.Tensor, fix: PositionFix, inv_freq: torch.Tensor, i: torch.Tensor,
              k_pos: torch.Tensor) -> torch.Tensor:
    """Keys (B, kv, k_len, D) rotated to their far positions for query rows like ``i`` (a scalar tensor)."""
    return rotate(key, fix.key_position(k_pos, i, torch) - k_pos, inv_freq)


def remapped_logits(query: torch.Tensor, key: torch.Tensor, fix: PositionFix, inv_freq: torch.Tensor,
                    q_pos: torch.Tensor, k_pos: torch.Tensor, far_keys: dict | None = None) -> torch.Tensor:
    """``q . k`` of every pair at its remapped positions (no ``scaling``, no mask).

    Parameters
    ----------
    query : Tensor of shape (batch, heads, q_len, head_dim)
        Post-RoPE queries at positions ``q_pos`` (scaled by ``alpha`` or not).
    key : Tensor of shape (batch, kv_heads, k_len, head_dim)
        Post-RoPE keys at positions ``k_pos`` (GQA: query head ``h`` reads key head ``h // groups``).
    fix : PositionFix
    inv_freq : Tensor of shape (head_dim / 2,)
        The rotation frequencies the model applied (its RoPE scaling included).
    q_pos, k_pos : Tensor of shape (q_len,), (k_len,), integers
    far_keys : dict, optional
        Keys already rotated to far positions, by key group; filled as computed (reuse across chunks).

    Returns
    -------
    Tensor of shape (batch, heads, q_len, k_len), in ``query``'s dtype (float32 at least)
    """
    groups = query.shape[1] // key.shape[1]
    far_keys = {} if far_keys is None else far_keys
    row_group = fix.key_group(q_pos, torch)  # (q_len,)
    dtype = torch.promote_types(query.dtype, torch.float32)
    logits = torch.empty(*query.shape[:3], key.shape[2], dtype=dtype, device=query.device)
    near_keys = None if fix.fix == "pi" else key.to(dtype).repeat_interleave(groups, dim=1)  # (B, H, k_len, D)
    for g in row_group.unique().tolist():
        rows = (row_group == g).nonzero().flatten()  # (r,)
        i = q_pos[rows]
        if g not in far_keys:
            far_keys[g] = _far_keys(key, fix, inv_freq, i[0], k_pos).repeat_interleave(groups, dim=1)
        q_far = rotate(query[:, :, rows], fix.query_position(i, torch) - i, inv_freq)  # (B, H, r, D)
        part = q_far.to(dtype) @ far_keys[g].to(dtype).transpose(-1, -2)  # (B, H, r, k_len)
        near = fix.near(i[:, None], k_pos[None])  # (r, k_len) or None
        if near is not None:
            plain = query[:, :, rows].to(dtype) @ near_keys.transpose(-1, -2)
            part = torch.where(near, plain, part)
        logits[:, :, rows] = part
    return logits


def remapped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                       fix: PositionFix, inv_freq: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                       visible: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(scaling * remapped_logits + mask) value``, chunked by query rows; returns (B, heads, q_len, D).

    Parameters
    ----------
    query, key, fix, inv_freq, q_pos, k_pos
        As for :func:`remapped_logits`.
    value : Tensor of shape (batch, kv_heads, k_len, head_dim)
    scaling : float
        The softmax scale the kernel would apply (``head_dim ** -0.5`` or the model's).
    visible : Tensor of bool, broadcastable to (batch, heads, q_len, k_len), optional
        The keys each row may attend (True: visible); None: causal by position (``k_pos <= q_pos``).
        A row that sees no key gets the plain kernel's uniform weights over a finfo.min row.
    """
    B, H, q_len, D = query.shape
    k_len = key.shape[2]
    groups = H // key.shape[1]
    if visible is None:
        visible = (k_pos[None, :] <= q_pos[:, None])[None, None]  # (1, 1, q_len, k_len)
    values = value.repeat_interleave(groups, dim=1)  # (B, H, k_len, D)
    out = torch.empty_like(query)
    step = max(1, _CHUNK_ELEMENTS // max(1, B * H * k_len))
    far_keys = {}
    for start in range(0, q_len, step):
        rows = slice(start, min(start + step, q_len))
        logits = remapped_logits(query[:, :, rows], key, fix, inv_freq, q_pos[rows], k_pos, far_keys) * scaling
        logits = logits.masked_fill(~visible[..., rows, :], torch.finfo(logits.dtype).min)
        weights = torch.softmax(logits, dim=-1).to(values.dtype)  # (B, H, r, k_len), float32 at least
        out[:, :, rows] = (weights @ values).to(out.dtype)
    return out
