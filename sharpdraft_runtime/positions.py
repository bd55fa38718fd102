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
:func:`remapped_logits` is that definition in plain math, for any positions. A query scaled by
``alpha(n)`` beforehand (``+spec``) scales both kinds of logits of its row, since rotations are linear.

The fast paths assume what a causal cache gives: keys at their slots ``0 .. k_len - 1`` and the
``q_len`` queries at the last ones (:func:`slot_positions`).

* A decoding step (one query row, at ``i = k_len - 1``): a rotation moves from the query to the key,
  ``R(u) q . R(v) k = q . R(v - u) k``, so each far key rotated once by its own
  ``(p_k - j) - (p_q - i)`` gives, against the query as it is, that row's remapped logit
  (:func:`decode_keys`). The caller's own kernel (sdpa, eager) can then attend over those keys: the
  cost is one rotation of the far keys, ``O(k_len d)`` elementwise, the order of the logits
  themselves; on the CPU in float32 one compiled pass (:mod:`sharpdraft_runtime.fused`), elsewhere
  torch's ops. A caller whose kernel is plain attention (the EAGLE-3 head) calls
  :func:`decode_attention` instead: on the CPU in float32 the compiled pass forms the logits
  directly, each far key rotated in registers, so no rotated copy is written or read again.
* Several rows (a draft block, a prefill): :func:`remapped_attention` in eager math (fp32 softmax),
  chunked by rows. Per row group (one for clamp and group; one per power of two for pi, a handful)
  the far keys are rotated once, and per chunk the queries once; the far logits cover only the
  columns some row of the chunk sees as far, the neighbour logits only those some row sees as near
  (the two overlap on a band as wide as the chunk), and GQA query heads share their key head by a
  reshape, never a copy of the keys.
* A DFlash block (:func:`attention_at`: its keys named by position) whose keys sit at their slots: on the
  CPU in float32 one compiled pass per row group (:func:`fused.block_logits`), each key read once, a far
  one rotated in a small buffer and dotted with every row and query head; elsewhere eager math.

Angles are formed in float64 (``shift * inv_freq``, a shift of thousands of positions keeps full
precision) and applied in the working precision (float32 at least). Nothing outlives a call.
"""

from __future__ import annotations

import numpy as np
import torch
from sharpdraft_theory.positions import PositionFix, pi_exponent

from . import fused

__all__ = ["rotate", "rotate_by", "cos_sin", "slot_positions", "at_slots", "remapped_logits", "decode_keys",
           "decode_attention", "remapped_attention", "attention_at", "identity_at"]

_CHUNK_ELEMENTS = 1 << 24  # logits held at once per chunk of query rows (64 MiB in float32)


def rotate(x: torch.Tensor, shift: np.ndarray, inv_freq: torch.Tensor, out: torch.Tensor | None = None,
           period: int = 1) -> torch.Tensor:
    """``x`` (B, heads, T, D), rotate-half RoPE, rotated further by ``shift`` (T,) positions.

    One cos and sin table (T, R/2) serves every batch row and head (:func:`cos_sin`; ``period`` as
    there). ``inv_freq`` (R/2,) may cover only the first ``R < D`` dimensions (partial rotary: the
    rest are not rotated, as RoPE left them). The rotation runs in ``x``'s precision (float32 at least)
    and is written to ``out`` (shape of ``x``, any floating dtype; a new tensor in ``x``'s dtype when
    None), which is returned.
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    return rotate_by(x, *cos_sin(np.asarray(shift, dtype=np.float64), inv_freq, dtype, x.device, period), out)


def rotate_by(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`rotate` with its table given: ``cos`` and ``sin`` (T, R/2) in ``x``'s precision (float32 at least)."""
    dtype = cos.dtype
    half = cos.shape[-1]
    width = 2 * half
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y = out if out.dtype == dtype else torch.empty(x.shape, dtype=dtype, device=x.device)
    x1, x2, y1, y2 = x[..., :half], x[..., half:width], y[..., :half], y[..., half:width]
    torch.mul(x1, cos, out=y1)
    y1.addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
    torch.mul(x2, cos, out=y2)
    y2.addcmul_(x1, sin)  # x2 cos + x1 sin
    if width < x.shape[-1]:
        y[..., width:] = x[..., width:]
    if y is not out:
        out.copy_(y)
    return out


def cos_sin(shift: np.ndarray, inv_freq: torch.Tensor, dtype: torch.dtype, device, period: int = 1
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of the angles ``shift * inv_freq``, shape (T, R/2) each, in ``dtype`` on ``device``.

    The angles are formed in float64 (a shift of thousands of positions keeps full precision). Shifts
    that add up over a period ``M``, ``shift[M u + v] = shift[M u] + shift[v] - shift[0]`` exactly (an
    arithmetic progression for any ``M``; Self-Extend's ``j // G - j`` for ``M`` a multiple of ``G``:
    ``period``), take their cos and sin from two small float64 tables, over ``u`` and over ``v``, by
    angle addition ``cos(a + b) = cos a cos b - sin a sin b``, ``sin(a + b) = sin a cos b + cos a sin b``:
    ``T / M + M`` rows of trigonometry instead of ``T``, the products in ``dtype`` (a few ulps of it). Any
    other shifts take theirs directly.
    """
    shift = np.asarray(shift, dtype=np.float64)
    T = shift.shape[0]
    M = _period(T, period)
    if T > 2 * M and _adds_up(shift, M):
        return _added(shift[::M], shift[:M] - shift[0], inv_freq, dtype, device, T)
    freq = inv_freq.detach().to(device=device, dtype=torch.float64)
    angles = torch.outer(torch.from_numpy(shift).to(device), freq)  # (T, R/2), float64
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _period(T: int, period: int) -> int:
    """The ``M`` of :func:`cos_sin` for ``T`` shifts: a multiple of ``period`` near ``sqrt(T)``."""
    return period * max(1, round(T ** 0.5 / period))


def _added(coarse: np.ndarray, fine: np.ndarray, inv_freq: torch.Tensor, dtype: torch.dtype, device, T: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cos_sin` of the ``T`` shifts ``coarse[u] + fine[v]`` at ``u M + v`` (``M = len(fine)``), by angle
    addition from one float64 table over both: ``len(coarse) + M`` rows of trigonometry."""
    U, M = len(coarse), len(fine)
    freq = inv_freq.detach().to(device=device, dtype=torch.float64)
    angles = torch.outer(torch.from_numpy(np.concatenate((coarse, fine))).to(device), freq)
    c, s = angles.cos().to(dtype), angles.sin().to(dtype)
    c_u, s_u, c_v, s_v = c[:U, None], s[:U, None], c[U:], s[U:]  # (U, 1, R/2), (M, R/2)
    cos = torch.mul(c_u, c_v)
    cos.addcmul_(s_u, s_v, value=-1)
    sin = torch.mul(s_u, c_v)
    sin.addcmul_(c_u, s_v)
    return cos.view(U * M, c.shape[-1])[:T], sin.view(U * M, c.shape[-1])[:T]  # (T, R/2) each


def _adds_up(shift: np.ndarray, M: int) -> bool:
    """Whether ``shift[M u + v] == shift[M u] + shift[v] - shift[0]`` for every index (exactly, in float64)."""
    T = shift.shape[0]
    U = -(-T // M)
    padded = np.full(U * M, np.nan)
    padded[:T] = shift
    grid = padded.reshape(U, M)
    want = grid[:, :1] + (shift[:M] - shift[0])
    return bool(np.all((grid == want) | np.isnan(grid)))


def slot_positions(q_len: int, k_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of a causal call whose keys sit at their cache slots: queries ``k_len - q_len ..``, keys ``0 ..``."""
    return torch.arange(k_len - q_len, k_len, device=device), torch.arange(k_len, device=device)


def at_slots(position_ids: torch.Tensor, k_len: int) -> bool:
    """Whether ``position_ids`` (batch or 1, q_len) put every query row at its cache slot, ``k_len - q_len ..``
    (what :func:`slot_positions` says). One row of one sequence on the CPU (a decoding step) is read as a number."""
    if position_ids.numel() == 1 and position_ids.device.type == "cpu":
        return int(position_ids) == k_len - 1
    q_len = position_ids.shape[-1]
    q_pos = torch.arange(k_len - q_len, k_len, device=position_ids.device)
    return torch.equal(position_ids, q_pos.expand_as(position_ids))


def _shifts(fix: PositionFix, i: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rotations (in positions) that take queries at ``i`` and keys at ``j`` to their far positions; ``j``'s
    are those of rows like ``i[0]`` (one row group)."""
    return fix.query_position(i) - i, fix.key_position(j, i[:1]) - j


def remapped_logits(query: torch.Tensor, key: torch.Tensor, fix: PositionFix, inv_freq: torch.Tensor,
                    q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """``q . k`` of every pair at its remapped positions (no ``scaling``, no mask): the plain definition.

    Both logit matrices in full (neighbour and far), merged by :meth:`PositionFix.near`, one row group
    at a time; :func:`remapped_attention` computes the same, faster, for keys at their slots.

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

    Returns
    -------
    Tensor of shape (batch, heads, q_len, k_len), in ``query``'s dtype (float32 at least)
    """
    B, H, _, D = query.shape
    kv, k_len = key.shape[1], key.shape[2]
    i_all, j = q_pos.cpu().numpy(), k_pos.cpu().numpy()
    row_group = fix.key_group(i_all)  # (q_len,)
    dtype = torch.promote_types(query.dtype, torch.float32)
    logits = torch.empty(B, H, len(i_all), k_len, dtype=dtype, device=query.device)
    keys = key.to(dtype)
    # GQA by reshape: query head h reads key head h // groups, so (B, H, r, D) -> (B, kv, groups * r, D)
    per_key = lambda x: x.reshape(B, kv, -1, D)  # noqa: E731
    for g in np.unique(row_group):
        rows = np.flatnonzero(row_group == g)
        r = len(rows)
        q_shift, k_shift = _shifts(fix, i_all[rows], j)
        far_keys = rotate(keys, k_shift, inv_freq)  # (B, kv, k_len, D)
        q_rows = query[:, :, rows].to(dtype)  # (B, H, r, D)
        part = (per_key(rotate(q_rows, q_shift, inv_freq)) @ far_keys.transpose(-1, -2)).view(B, H, r, k_len)
        near = fix.near(i_all[rows, None], j[None])  # (r, k_len) or None
        if near is not None:
            plain = (per_key(q_rows) @ keys.transpose(-1, -2)).view(B, H, r, k_len)
            part = torch.where(torch.as_tensor(near, device=query.device), plain, part)
        logits[:, :, rows] = part
    return logits


def identity_at(fix: PositionFix, q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """Whether every pair of queries at ``q_pos`` and keys at ``k_pos`` keeps its own positions under ``fix``: for
    clamp and group, every distance under the window; for pi, every query before ``n_ref`` (its exponent 0)."""
    span = int(q_pos.max()) - (0 if fix.fix == "pi" else int(k_pos.min()))
    return span < fix.identity_limit


def attention_at(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, fix: PositionFix,
                 inv_freq: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                 visible: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(scaling * remapped_logits + mask) value`` for queries and keys at any positions, in eager math.

    For calls whose keys are not at their cache slots: a DFlash block's context keys then its own (non-causal,
    the block's keys after some of its rows), or many blocks of one teacher-forced call side by side.
    :func:`remapped_logits` is the definition; ``visible`` (bool, broadcastable to (batch, heads, q_len,
    k_len), True where a key is visible; None: every key) is the call's mask. Returns (batch, heads, q_len,
    head_dim) in ``query``'s dtype; the softmax in float32 at least.

    Keys at their slots (``k_pos`` is ``0 .. k_len - 1``: one DFlash block after its whole context), float32 on
    the CPU and no gradient (:func:`_block_pass`) take one compiled pass over the keys per row group
    (:func:`_block_logits`): no rotated copy of the keys, no second logit matrix to merge.
    """
    B, H, q_len, D = query.shape
    kv, k_len = key.shape[1], key.shape[2]
    if _block_pass(query, key, value, k_pos):
        logits = _block_logits(query, key, scaling, fix, inv_freq, q_pos.cpu().numpy())
    else:
        logits = remapped_logits(query, key, fix, inv_freq, q_pos, k_pos) * scaling  # (B, H, q_len, k_len)
    if visible is not None:
        logits = logits.masked_fill(~visible, torch.finfo(logits.dtype).min)
    weights = torch.softmax(logits, dim=-1).to(value.dtype).view(B, kv, (H // kv) * q_len, k_len)  # GQA by reshape
    return (weights @ value).view(B, H, q_len, D).to(query.dtype)


def _block_pass(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_pos: torch.Tensor) -> bool:
    """Whether :func:`attention_at` takes the compiled block pass: float32 on the CPU with no gradient wanted
    (:func:`fused.usable`; the pass's logits carry none back), and the keys at their slots."""
    return (fused.usable(key) and query.dtype == value.dtype == torch.float32 and value.device.type == "cpu"
            and not query.requires_grad and k_pos.shape == (key.shape[2],)
            and torch.equal(k_pos.cpu(), torch.arange(key.shape[2])))


def _block_logits(query: torch.Tensor, key: torch.Tensor, scaling: float, fix: PositionFix, inv_freq: torch.Tensor,
                  i_all: np.ndarray) -> torch.Tensor:
    """``scaling`` times :func:`remapped_logits` (B, H, q_len, k_len), float32, for query rows at positions ``i_all``
    (q_len,) and keys at their slots, by :func:`fused.block_logits`: per row group (:meth:`PositionFix.key_group`)
    the rows' queries rotated to their far positions (a small tensor), then one pass over the keys, each far key
    rotated by the group's law (:func:`_key_law`) in a small buffer, never a copy of all keys, and dotted with every
    row and query head that share it."""
    B, H, q_len, _ = query.shape
    k_len = key.shape[2]
    row_group = fix.key_group(i_all)  # (q_len,)
    logits = torch.empty(B, H, q_len, k_len, dtype=torch.float32)
    window = None if fix.near(0, 0) is None else fix.window
    for g in np.unique(row_group):
        rows = np.flatnonzero(row_group == g)
        i = i_all[rows]
        q_shift, _ = _shifts(fix, i, np.arange(0))
        q_rows = query[:, :, rows]
        _, far_to = _far_columns(fix, int(i.min()), int(i.max()), k_len)
        logits[:, :, rows] = fused.block_logits(q_rows, rotate(q_rows, q_shift, inv_freq), key, i, window, far_to,
                                                _key_law(fix, i[0]), inv_freq, scaling)
    return logits


def _far_columns(fix: PositionFix, first: int, last: int, k_len: int) -> tuple[int, int]:
    """``(near_from, far_to)`` for query rows ``first .. last`` over keys at slots ``0 .. k_len - 1``: keys
    below ``near_from`` are far for every row, keys from ``far_to`` on near for every row (between: a band).

    A key is near while ``i - j < W`` (:meth:`PositionFix.near`), so the far keys of row ``i`` are
    ``j <= i - W``: a prefix. pi keeps no key apart: every key is far.
    """
    if fix.near(first, 0) is None:
        return k_len, k_len
    clip = lambda far: min(max(far, 0), k_len)  # noqa: E731
    return clip(first - fix.window + 1), clip(last - fix.window + 1)


def decode_keys(key: torch.Tensor, fix: PositionFix, inv_freq: torch.Tensor, tables: dict | None = None
                ) -> torch.Tensor:
    """The keys whose plain logits with a decoding step's query are its remapped logits.

    The query sits at the last slot ``i = k_len - 1`` and key ``j`` at slot ``j``. Its far logit is
    ``R(p_q - i) q . R(p_k - j) k = q . R((p_k - j) - (p_q - i)) k``: each far key is rotated once by
    its own shift, the neighbour keys are copied as they are.

    Parameters
    ----------
    key : Tensor of shape (batch, kv_heads, k_len, head_dim)
        Post-RoPE keys at their slots.
    fix, inv_freq
        As for :func:`remapped_logits`.
    tables : dict, optional
        Where the rotation table is kept for other calls with the same ``fix``, ``inv_freq`` and
        ``k_len`` (the layers of one decoding step), keyed by ``k_len``, dtype and device; the caller
        owns it and drops it when the step ends. None: the table is made for this call alone.

    Returns
    -------
    Tensor of shape (batch, kv_heads, k_len, head_dim), in ``key``'s dtype: a new tensor, attended by
    the caller's kernel with the query, the values, the mask and the scaling unchanged.
    """
    k_len = key.shape[2]
    far, _ = _far_columns(fix, k_len - 1, k_len - 1, k_len)
    if fused.usable(key):  # one compiled pass: each far key read once and written rotated, no table
        return fused.rotate_far_keys(key, far, _decode_law(fix, k_len - 1), inv_freq)
    dtype = torch.promote_types(key.dtype, torch.float32)
    memo = (k_len, dtype, key.device)
    table = None if tables is None else tables.get(memo)
    if table is None:
        table = _decode_table(fix, k_len, far, inv_freq, dtype, key.device)
        if tables is not None:
            tables[memo] = table
    keys = torch.empty_like(key)
    keys[:, :, far:] = key[:, :, far:]
    rotate_by(key[:, :, :far], *table, out=keys[:, :, :far])
    return keys


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, fix: PositionFix,
                     inv_freq: torch.Tensor, kernel, visible: torch.Tensor | None = None, tables: dict | None = None
                     ) -> torch.Tensor:
    """A decoding step's attention at the fix's positions, for a caller whose kernel is plain attention.

    ``softmax(scaling * q . k + mask) v`` over the keys of :func:`decode_keys`, query row at ``k_len - 1``.
    float32 on the CPU (:func:`fused.usable`) runs it without writing those keys: the compiled pass forms
    the logits, each far key rotated in registers (:func:`fused.decode_logits`), then one softmax and one
    product with the values (query heads grouped over their key head by a reshape, GQA). Anything else
    calls ``kernel(query, keys, value)`` (the caller's own, its mask and scaling bound) over
    :func:`decode_keys`' keys (``tables`` as there).

    ``visible``: bool, broadcastable to (batch, heads, 1, k_len), True where a key is seen (None: every key);
    it is applied on the compiled path only, so ``kernel`` must apply the same. Returns (batch, heads, 1, D).
    """
    if not (fused.usable(key) and query.dtype == value.dtype == torch.float32 and value.device.type == "cpu"
            and not query.requires_grad):  # the pass's logits carry no gradient back to the query
        return kernel(query, decode_keys(key, fix, inv_freq, tables), value)
    k_len = key.shape[2]
    far, _ = _far_columns(fix, k_len - 1, k_len - 1, k_len)
    logits = fused.decode_logits(query, key, far, _decode_law(fix, k_len - 1), inv_freq, scaling)
    if visible is not None:
        logits = logits.masked_fill(~visible, torch.finfo(logits.dtype).min)
    B, heads, _, D = query.shape
    weights = torch.softmax(logits, dim=-1).view(B, key.shape[1], heads // key.shape[1], k_len)
    return torch.matmul(weights, value).view(B, heads, 1, D)


def _key_law(fix: PositionFix, i: int) -> tuple[float, float, int]:
    """``(a, b, G)``: far key ``j``'s shift ``p_k - j`` for rows like ``i`` (one row group) is ``a j + b (j // G)``.

    clamp (``p_k = 0``): ``-j``; group (``p_k = j // G``): ``-j + j // G``; pi (``p_k = s j``, ``s = 2^-e``
    for row ``i``, dyadic, so exact in float64): ``(s - 1) j``. Tested against :class:`PositionFix`'s mapping.
    """
    if fix.fix == "clamp":
        return -1.0, 0.0, 1
    if fix.fix == "group":
        return -1.0, 1.0, fix.group
    return 2.0 ** -pi_exponent(int(i), fix.n_ref) - 1.0, 0.0, 1


def _decode_law(fix: PositionFix, i: int) -> tuple[float, float, int, float]:
    """``(a, b, G, c)``: far key ``j``'s shift ``p_k - j - (p_q - i)`` for the query row at ``i`` is
    ``a j + b (j // G) + c``: :func:`_key_law` less the query's own shift ``p_q - i``, every term exact in
    float64."""
    return *_key_law(fix, i), float(i - fix.query_position(int(i)))


def _decode_shifts(fix: PositionFix, k_len: int, far: int) -> tuple[np.ndarray, np.ndarray]:
    """The far keys' shifts of :func:`decode_keys` (:func:`_decode_law`) as ``coarse`` (U,) and ``fine`` (M,):
    key ``j``'s shift is ``coarse[j // M] + fine[j % M]``, which :func:`_added` turns into a table from
    ``U + M`` rows of trigonometry.

    ``M`` is a multiple of ``G`` near ``sqrt(far)`` (:func:`cos_sin`), so ``(u M + v) // G = u M / G + v // G``
    and the law splits exactly. A short run (``far <= 2 M``) is all coarse.
    """
    a, b, G, c = _decode_law(fix, k_len - 1)
    law = lambda j: a * j + b * (j // G) + c  # noqa: E731
    M = _period(far, G)
    if far <= 2 * M:
        return law(np.arange(far, dtype=np.float64)), np.zeros(1)
    return law(np.arange(0, far, M, dtype=np.float64)), law(np.arange(M, dtype=np.float64)) - c


def _decode_table(fix: PositionFix, k_len: int, far: int, inv_freq: torch.Tensor, dtype: torch.dtype, device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation table of :func:`decode_keys`' torch path: cos and sin (far, R/2) of the far keys' shifts."""
    return _added(*_decode_shifts(fix, k_len, far), inv_freq, dtype, device, far)


def remapped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                       fix: PositionFix, inv_freq: torch.Tensor,
                       visible: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(scaling * remapped_logits + mask) value`` for queries at the last ``q_len`` slots, keys at
    theirs; chunked by query rows. Returns (batch, heads, q_len, head_dim) in ``query``'s dtype.

    Parameters
    ----------
    query : Tensor of shape (batch, heads, q_len, head_dim)
        Post-RoPE queries at slots ``k_len - q_len ..`` (scaled by ``alpha`` or not).
    key, value : Tensor of shape (batch, kv_heads, k_len, head_dim)
        Post-RoPE keys and the values, at slots ``0 .. k_len - 1``.
    scaling : float
        The softmax scale the kernel would apply (``head_dim ** -0.5`` or the model's).
    fix, inv_freq
        As for :func:`remapped_logits`.
    visible : Tensor of bool, broadcastable to (batch, heads, q_len, k_len), optional
        The keys each row may attend (True: visible); None: causal by position (``j <= i``).
        A row that sees no key gets the plain kernel's uniform weights over a finfo.min row.
    """
    B, H, q_len, D = query.shape
    kv, k_len = key.shape[1], key.shape[2]
    groups = H // kv
    dtype = torch.promote_types(query.dtype, torch.float32)
    rows_at = np.arange(k_len - q_len, k_len)  # query positions
    row_group = fix.key_group(rows_at)  # (q_len,), constant on runs of rows
    if visible is None:
        visible = torch.arange(k_len, device=query.device) <= torch.as_tensor(rows_at, device=query.device)[:, None]
    visible = visible.expand(B, H, q_len, k_len).view(B, kv, groups, q_len, k_len)  # a view, no copy
    out = torch.empty_like(query)
    step = max(1, _CHUNK_ELEMENTS // max(1, B * H * k_len))
    for g in np.unique(row_group):
        group_rows = np.flatnonzero(row_group == g)  # contiguous: the exponent grows with the position
        _, far_to = _far_columns(fix, rows_at[group_rows[0]], rows_at[group_rows[-1]], k_len)
        if fused.usable(key) and dtype == key.dtype:  # one compiled pass, as for a decoding step
            far_keys = fused.rotate_far_keys(key[:, :, :far_to], far_to,
                                             (*_key_law(fix, rows_at[group_rows[0]]), 0.0), inv_freq)
        else:
            _, k_shift = _shifts(fix, rows_at[group_rows], np.arange(far_to))
            far_keys = rotate(key[:, :, :far_to], k_shift, inv_freq, period=fix.group or 1,
                              out=torch.empty(B, kv, far_to, D, dtype=dtype, device=key.device))  # (B, kv, far, D)
        for start in range(group_rows[0], group_rows[-1] + 1, step):
            rows = slice(start, min(start + step, group_rows[-1] + 1))
            out[:, :, rows] = _chunk(query[:, :, rows].to(dtype) * scaling, key, value, far_keys, fix, inv_freq,
                                     rows_at[rows], visible[..., rows, :], dtype)
    return out


def _chunk(query, key, value, far_keys, fix, inv_freq, rows_at, visible, dtype) -> torch.Tensor:
    """Attention of one chunk of rows (one row group), (B, H, r, D); ``query`` (B, H, r, D) is in the working
    dtype and already times ``scaling``, ``far_keys`` (B, kv, >= far_to, D) the group's far keys."""
    B, H, r, D = query.shape
    kv, k_len = key.shape[1], key.shape[2]
    near_from, far_to = _far_columns(fix, rows_at[0], rows_at[-1], k_len)
    q_shift, _ = _shifts(fix, rows_at, np.arange(0))
    per_key = lambda x: x.reshape(B, kv, -1, D)  # noqa: E731  (B, H, r, D) -> (B, kv, groups * r, D), GQA
    q_far = per_key(rotate(query, q_shift, inv_freq, out=torch.empty(query.shape, dtype=dtype, device=query.device)))
    far = q_far @ far_keys[:, :, :far_to].transpose(-1, -2)  # (B, kv, groups * r, far_to)
    if near_from < k_len:
        near = per_key(query) @ key[:, :, near_from:].to(dtype).transpose(-1, -2)  # (.., k_len - near_from)
        band = torch.as_tensor(fix.near(rows_at[:, None], np.arange(near_from, far_to)[None]), device=query.device)
        band = torch.where(band.repeat(H // kv, 1), near[..., :far_to - near_from], far[..., near_from:])
        far = torch.cat((far[..., :near_from], band, near[..., far_to - near_from:]), dim=-1)
    logits = far.view(B, kv, H // kv, r, k_len).masked_fill_(~visible, torch.finfo(dtype).min)
    weights = torch.softmax(logits, dim=-1).to(value.dtype).view(B, kv, -1, k_len)  # float32 at least
    return (weights @ value).view(B, H, r, D)
