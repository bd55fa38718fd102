"""Reduce sampled attention rows to per-row statistics, chunk by chunk, without an n x n matrix.

A drafter's attention taps hand this module post-RoPE queries and keys (``calibrate.taps``,
the EAGLE-3 and DFlash adapters). ``RowCollector`` keeps the query rows whose visible-key count
``n`` lies on a log-spaced grid, computes their logits ``z_j = scaling * <q, k_j>`` against the
first ``n`` keys in chunks of rows, and reduces each chunk at once, in fp32, to the sufficient
statistics of ``sharpdraft_theory.stats.RowStats`` (theory.md section 6):

    top         the k_max largest z_j, descending
    lse[a]      ln sum_j exp(a z_j)               for every a on the alpha grid
    tilted_mean sum_j z_j e^{z_j} / sum_j e^{z_j}
    mean, var   plain mean and population variance of the z_j

``distance_sums`` adds, summed over the chunk's rows, the background's distance profile of
``sharpdraft_theory.stats.DistanceStats`` (theory.md section 8); ``take()`` returns it with the rows.
``budget_shares`` adds each row's attention budget (``sharpdraft_theory.stats.AttentionBudget``:
mass on sink, local and far keys at alpha = 1) from the same shifted logits and ``S(1)``.

``row_stats_from_logits`` in ``sharpdraft_theory.stats`` is the float64 numpy version of the
same reduction; the tests hold this one to it.

Memory: a chunk holds at most ``budget`` logits (plus three same-sized temporaries and, on CPU,
tiles of a fixed size), so the extra memory of calibration is bounded whatever the sequence
length. Rows are grouped by ``n`` (at most 1.5x apart) so a chunk's key range is cut at its
longest row, and short rows do not pay for long ones.

On CUDA the reduction runs on a side stream, overlapping the drafter's forward pass: the
forward only hands over its queries and keys, and the statistics come back to the host once per
sequence (``RowCollector.take``). On CPU it runs in line, on one intra-op thread.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from sharpdraft_theory.stats import (DEFAULT_ALPHA_GRID, DEFAULT_SINKS, DISTANCE_ALPHAS, AttentionBudget, DistanceStats,
                                     RowStats, distance_edges)

from .errors import UserError

__all__ = ["log_grid", "alpha_lattice", "AlphaLattice", "reduce_rows", "distance_sums", "budget_shares", "Workspace",
           "RowCollector", "DEFAULT_K_MAX", "DEFAULT_BUDGET"]

DEFAULT_K_MAX = 16  # top logits kept per row: any --top-k up to this can be fitted later
DEFAULT_BUDGET = 1 << 19  # logits per chunk (2 MiB in fp32, about 4x that in temporaries); --chunk: rows
_CPU_THREADS = 1  # intra-op threads of the reduction on CPU (see _cpu_threads)
_TILE = 1 << 14  # logits per tile of the alpha-grid sums on CPU: W and X (25x a tile) stay in L2 cache
_EXP2_FLOOR = -63.0  # exponent floor: products of two factors stay normal floats (see reduce_rows)
_MAX_LATTICE_WASTE = 4  # a lattice may hold at most this many points per grid value (see alpha_lattice)
_LOG2E = math.log2(math.e)


def log_grid(max_length: int, *, per_octave: int = 8, n_min: int = 32) -> np.ndarray:
    """Visible-key counts sampled in each sequence: ``per_octave`` per doubling, ``n_min..max_length``.

    Rounded to integers and deduplicated; always includes ``max_length``.

    >>> log_grid(256).tolist()
    [32, 35, 38, 41, 45, 49, 54, 59, 64, 70, 76, 83, 91, 99, 108, 117, 128, 140, 152, 166, 181, 197, 215, 235, 256]
    """
    if max_length < n_min:
        return np.array([max_length], dtype=np.int64)
    octaves = math.log2(max_length / n_min)
    steps = np.arange(0, math.floor(octaves * per_octave + 1e-9) + 1)
    grid = np.round(n_min * 2.0 ** (steps / per_octave)).astype(np.int64)
    return np.unique(np.append(grid, max_length))


@dataclass(frozen=True)
class AlphaLattice:
    """The alpha grid written as a lattice, ``a_i = a_0 + (p_i Q + q_i) delta``, for the product form.

    ``2^{a_i s'} = 2^{(a_0 + p_i Q delta) s'} * 2^{q_i delta s'}``: one factor per row ``p`` of ``W``
    and one per column ``q`` of ``X`` (``reduce_rows``). A grid that is not on a lattice of its
    smallest step (or would waste more than ``_MAX_LATTICE_WASTE`` of it) gets one row per value
    and a single column (``delta = 0``).
    """

    values: torch.Tensor  # (n_alpha,) float32: the grid itself
    base: torch.Tensor  # (P,) float32: (a_0 + p Q delta) * log2(e), the exponent scale of row p
    step: torch.Tensor  # (Q,) float32: q delta * log2(e), the exponent scale of column q
    index: torch.Tensor  # (n_alpha,) int64: p_i Q + q_i, grid value i in the flattened (P, Q) product
    one: int  # grid index of alpha = 1 (the tilted mean is taken there)
    one_step: int  # its p Q + q, kept on the host so reading it never waits for a device


def alpha_lattice(alpha_grid, columns: int = 16) -> AlphaLattice:
    """Factor ``alpha_grid`` (increasing, > 0, holding 1.0) for ``reduce_rows``; ``columns`` is Q.

    >>> lat = alpha_lattice([0.5, 0.75, 1.0, 1.5], columns=2)  # a = 0.5 + (2 p + q) 0.25
    >>> lat.index.tolist(), (lat.base / math.log2(math.e)).tolist(), (lat.step / math.log2(math.e)).tolist()
    ([0, 1, 2, 4], [0.5, 1.0, 1.5], [0.0, 0.25])
    """
    grid = np.asarray(alpha_grid, dtype=np.float64)
    if grid.ndim != 1 or grid.size == 0 or grid[0] <= 0 or np.any(np.diff(grid) <= 0):
        raise ValueError("alpha_grid must be increasing and positive")
    one = int(np.argmin(np.abs(grid - 1.0)))
    if abs(grid[one] - 1.0) > 1e-6:
        raise ValueError("alpha_grid must contain 1.0")
    delta = float(np.diff(grid).min()) if grid.size > 1 else 0.0
    steps = np.round((grid - grid[0]) / delta).astype(np.int64) if delta else np.zeros(grid.size, np.int64)
    if delta and np.allclose(grid[0] + steps * delta, grid, rtol=0, atol=1e-9) \
            and steps[-1] < _MAX_LATTICE_WASTE * grid.size:
        columns = min(columns, int(steps[-1]) + 1)
        base = grid[0] + np.arange(steps[-1] // columns + 1) * columns * delta
        step = np.arange(columns) * delta
    else:  # one row per value and a column of ones: W @ X is a plain sum per value
        steps, base, step = np.arange(grid.size), grid, np.zeros(1)
    return AlphaLattice(values=torch.tensor(grid, dtype=torch.float32),
                        base=torch.tensor(base * _LOG2E, dtype=torch.float32),
                        step=torch.tensor(step * _LOG2E, dtype=torch.float32), index=torch.as_tensor(steps), one=one,
                        one_step=int(steps[one]))


def reduce_rows(query: torch.Tensor, key: torch.Tensor, n_visible: torch.Tensor, scaling: float, *,
                k_max: int, alpha_grid, workspace: Workspace | None = None,
                distance: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_budget: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """Statistics of the rows ``scaling * query @ key[:n].T`` for one chunk, in fp32.

    Parameters
    ----------
    query : Tensor, shape (kv_heads, group, rows, head_dim)
        Query rows, grouped under the key head they read (GQA: ``group = heads // kv_heads``).
    key : Tensor, shape (kv_heads, keys, head_dim)
        Keys; row ``r`` sees the first ``n_visible[r]`` of them.
    n_visible : LongTensor, shape (rows,)
        Visible keys per row, each in ``(k_max, keys]``.
    scaling : float
        Softmax scale folded into the logits.
    k_max : int
        Top logits kept per row.
    alpha_grid : sequence of float or AlphaLattice
        Query scales for ``lse`` (increasing, all > 0, holding 1.0), or their ``alpha_lattice``.
    workspace : Workspace, optional
        Scratch buffers to reuse across calls (default: fresh ones).
    distance : (edges, alphas), optional
        Also return ``distance_sums`` of the chunk under the key ``distance`` (every alpha on
        ``alpha_grid``).
    attention_budget : (sinks, window), optional
        Also return ``budget_shares`` of the rows under the key ``budget``.

    Returns
    -------
    dict of fp32 tensors with leading shape (kv_heads, group, rows): ``top`` (.., k_max),
    ``lse`` (.., n_alpha), ``tilted_mean``, ``mean``, ``var``.

    Notes
    -----
    With ``s_j = z_j - max z`` (so ``s_j <= 0``), ``lse(a) = a max z + ln S(a)``,
    ``S(a) = sum_j 2^{a s'_j}``, ``s' = s log2 e``. On the lattice ``a_i = a_0 + (p_i Q + q_i) delta``
    (``AlphaLattice``), ``2^{a_i s'_j} = W[p_i, j] X[j, q_i]`` with ``W[p, j] = 2^{(a_0 + p Q delta) s'_j}``
    and ``X[j, q] = 2^{q delta s'_j}``, so every ``S(a_i)`` of a row is an entry of one small matrix
    product ``W @ X``: (P + Q) exponentials per logit (25 for the default 101-value grid) and a
    batched matrix product, instead of a pass over the logits per grid value. Each factor is a
    direct ``exp2`` (at most a few ulp per term, no drift along the grid).

    Exponents are floored at -63, so every factor and product is a normal float (subnormal
    arithmetic is tens of times slower on x86). A term below ``2^-63`` (and a hidden key, whose
    ``W`` is ``2^-63`` instead of 0) then adds at most ``2^-63`` to a sum whose largest term is
    ``2^0 = 1``: a relative change below ``keys * 1.1e-19``, far under fp32 resolution.

    Work is cut into tiles of at most ``_TILE`` logits on CPU (rows, and keys when a row is
    longer), so ``W`` and ``X`` stay in cache and extra memory is bounded; tile sums add up in
    float64. On CUDA a chunk is one tile. Mean and variance come from sums over all keys with the
    hidden ones at ``s = 0``, corrected exactly for them (fp32 sums, which torch accumulates in
    cascade on CPU and as a tree on CUDA). Temporaries live in ``workspace``.
    """
    lattice = alpha_grid if isinstance(alpha_grid, AlphaLattice) else alpha_lattice(alpha_grid)
    ws = workspace if workspace is not None else Workspace()
    kv_heads, group, rows, head_dim = query.shape
    keys = key.shape[1]
    device = key.device
    f32 = torch.float32
    logits = torch.matmul(query.reshape(kv_heads, group * rows, head_dim).float(), key.float().transpose(-1, -2),
                          out=ws.take("logits", (kv_heads, group * rows, keys), f32, device))  # one product per key head
    logits = logits.view(kv_heads, group, rows, keys).mul_(scaling)  # (KVH, G, R, N)
    positions = torch.arange(keys, out=ws.take("positions", (keys,), torch.int64, device))
    hidden = torch.ge(positions, n_visible[:, None], out=ws.take("hidden", (rows, keys), torch.bool, device))
    logits.masked_fill_(hidden, float("-inf"))
    top, top_index = torch.topk(logits, k_max, dim=-1)  # (KVH, G, R, k_max), descending
    peak = top[..., :1]
    shifted = logits.sub_(peak)  # s_j <= 0; -inf where hidden
    zeroed = torch.where(hidden, shifted.new_zeros(()), shifted, out=ws.take("zeroed", shifted.shape, f32, device))
    n = n_visible.to(f32)
    mean_s = zeroed.sum(-1) / n
    square_sum = torch.mul(zeroed, zeroed, out=ws.take("square", zeroed.shape, f32, device)).sum(-1)
    var = square_sum.double() / n - mean_s.double() ** 2

    base, step = lattice.base.to(device), lattice.step.to(device)
    n_rows = kv_heads * group * rows
    s_rows, z_rows = shifted.view(n_rows, keys), zeroed.view(n_rows, keys)
    sums = torch.zeros(n_rows, base.numel(), step.numel(), dtype=torch.float64, device=device)  # S per (p, q)
    tilted = torch.zeros(n_rows, dtype=torch.float64, device=device)  # sum_j s_j e^{s_j}
    p_one, q_one = divmod(lattice.one_step, step.numel())
    tile = n_rows * keys if device.type == "cuda" else _TILE
    rows_per_tile = max(1, tile // keys)
    keys_per_tile = max(1, tile // rows_per_tile)
    for lo in range(0, n_rows, rows_per_tile):
        hi = min(lo + rows_per_tile, n_rows)
        for k_lo in range(0, keys, keys_per_tile):
            s_tile, z_tile = s_rows[lo:hi, k_lo:k_lo + keys_per_tile], z_rows[lo:hi, k_lo:k_lo + keys_per_tile]
            r, k = s_tile.shape
            w = torch.mul(s_tile[:, None, :], base[:, None], out=ws.take("w", (r, base.numel(), k), f32, device))
            torch.exp2(w.clamp_(min=_EXP2_FLOOR), out=w)  # (r, P, k)
            x = torch.mul(z_tile[:, :, None], step, out=ws.take("x", (r, k, step.numel()), f32, device))
            torch.exp2(x.clamp_(min=_EXP2_FLOOR), out=x)  # (r, k, Q)
            sums[lo:hi] += torch.bmm(w, x)  # (r, P, Q)
            e_one = torch.mul(w[:, p_one], x[:, :, q_one], out=ws.take("e_one", (r, k), f32, device))  # e^{s_j}
            tilted[lo:hi] += e_one.mul_(z_tile).sum(-1)  # at alpha = 1: sum s e^s
    lead = sums.view(n_rows, -1)[:, lattice.index.to(device)].view(kv_heads, group, rows, -1)  # (.., n_alpha)
    tilted = peak[..., 0] + (tilted.view(kv_heads, group, rows) / lead[..., lattice.one]).float()
    if distance is not None:  # S(a) at the profile's scales, before lead becomes ln S
        values = lattice.values.to(device)
        at = (values[:, None] - torch.tensor(distance[1], dtype=values.dtype, device=device)).abs_().argmin(0)
        row_sums = lead.index_select(-1, at)  # (KVH, G, R, A): sum_j e^{a s_j}, float64
    shares = None
    if attention_budget is not None:  # S(1) is read before lead becomes ln S
        shares = budget_shares(shifted, n_visible, lead[..., lattice.one], *attention_budget, workspace=ws)
    out = dict(top=top, lse=lead.log_().float() + peak * lattice.values.to(device), tilted_mean=tilted,
               mean=peak[..., 0] + mean_s, var=var.clamp_(min=0.0).float())
    if shares is not None:
        out["budget"] = shares
    if distance is None:
        return out
    return {**out, "distance": distance_sums(shifted, top_index, n_visible, row_sums, *distance)}


class Workspace:
    """Scratch buffers that ``reduce_rows`` reuses from chunk to chunk: one per name, grown as needed.

    Fresh memory is faulted in page by page on first touch; for the reduction's medium-sized
    temporaries that costs as much as the arithmetic on them whenever the allocator hands freed
    blocks back to the system (glibc does for blocks above its mmap threshold). ``RowCollector``
    keeps one per attention call, so the buffers are gone before the rest of the layer runs and
    calibration's peak memory stays that of the forward pass.
    """

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of ``shape`` over buffer ``name`` (contents undefined); valid until the next take of ``name``."""
        size = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < size or buffer.dtype != dtype or buffer.device != device:
            buffer = self._buffers[name] = torch.empty(size, dtype=dtype, device=device)
        return buffer[:size].view(shape)


def distance_sums(shifted: torch.Tensor, top_index: torch.Tensor, n_visible: torch.Tensor, row_sums: torch.Tensor,
                  edges: torch.Tensor, alphas: torch.Tensor) -> dict[str, torch.Tensor]:
    """The background's distance profile of one chunk, summed over its rows (``DistanceStats``).

    Parameters
    ----------
    shifted : Tensor, shape (kv_heads, group, rows, keys)
        Logits minus each row's largest, ``s_j = z_j - t0 <= 0``; ``-inf`` where hidden (read only).
    top_index : LongTensor, shape (kv_heads, group, rows, k_max)
        Keys of each row's top set (left out of the background).
    n_visible : LongTensor, shape (rows,)
        Visible keys per row (the first ``n`` keys).
    row_sums : Tensor, shape (kv_heads, group, rows, A)
        ``sum_j exp(a s_j)`` over all visible keys at each of ``alphas`` (the sink's share needs it).
    edges : LongTensor, shape (B + 1,)
        Distance bins ``edges[b] <= d < edges[b + 1]``, ``d = n - j``.
    alphas : sequence of float
        Query scales, each a multiple of 1/4 (``DISTANCE_ALPHAS``).

    Returns
    -------
    dict of fp64 tensors: ``weight`` (kv_heads, group, B, A), ``keys`` (kv_heads, group, B),
    ``sink`` (kv_heads, group, A), ``rows`` (kv_heads, group).

    Notes
    -----
    Keys are gathered by distance, ``aligned[.., r, d - 1] = s[.., r, n_r - d]``, so all rows
    share one distance axis: the sum over rows comes first, then bin sums as differences of a
    cumulative sum over distance (float64). The weights are powers of ``u = exp(s / 4)``,
    ``exp(a s) = u^{4a}``, made by in-place multiplication (one ``exp`` per logit in all). On CPU
    subnormal results are flushed to 0 (``_flush_denormal``): a weight under 1e-38 is dropped,
    where computing it would take the processor's slow path.
    """
    kvh, group, rows, keys = shifted.shape
    device = shifted.device
    quarters = [int(round(4 * float(a))) for a in alphas]
    if quarters != sorted(set(quarters)) or quarters[0] < 1:
        raise ValueError("distance alphas must be increasing positive multiples of 1/4")
    scales = torch.tensor([q / 4.0 for q in quarters], device=device)
    sink = (torch.exp(shifted[..., :1].double() * scales) / row_sums.double()).sum(-2)  # (KVH, G, A)
    j = n_visible[:, None] - torch.arange(1, keys + 1, device=device)  # (R, N): key at distance d = 1 .. N
    aligned = shifted.gather(-1, j.clamp(min=0).expand(kvh, group, rows, keys))  # (KVH, G, R, N) by distance
    with _flush_denormal(device):
        unit = torch.exp(aligned.mul_(0.25))  # (KVH, G, R, N): u = e^{s/4}
        unit.masked_fill_(j < 1, 0.0)  # the sink (d = n) and distances past the row
        unit.scatter_(-1, n_visible[:, None] - 1 - top_index, 0.0)  # top keys: d - 1 = n - 1 - j
        steps = {1: unit}
        for step in (2, 4):  # u^2, u^4: the steps between consecutive quarters
            steps[step] = steps[step // 2] * steps[step // 2]
        per_d, power, q_now = [], None, 0
        for q in quarters:  # u^q by in-place steps from the previous quarter
            while q_now < q:
                step = max(s for s in steps if s <= q - q_now)  # greedy: u^4, u^2 or u
                power = steps[step].clone() if power is None else power.mul_(steps[step])
                q_now += step
            per_d.append(power.sum(2, dtype=torch.float64))  # (KVH, G, N)
        per_d.append((unit > 0).sum(2, dtype=torch.float64))  # background keys per distance
    cum = torch.nn.functional.pad(torch.stack(per_d, -1).cumsum(2), (0, 0, 1, 0))  # (KVH, G, N + 1, A + 1)
    at = (edges - 1).clamp(max=keys)  # (B + 1,): sums over d < edges[b]
    binned = cum[:, :, at[1:]] - cum[:, :, at[:-1]]  # (KVH, G, B, A + 1)
    weight, count = binned[..., :-1], binned[..., -1]  # (KVH, G, B, A), (KVH, G, B)
    return dict(weight=weight, keys=count, sink=sink,
                rows=torch.full((kvh, group), float(rows), dtype=torch.float64, device=device))


def budget_shares(shifted: torch.Tensor, n_visible: torch.Tensor, total: torch.Tensor, sinks: int, window: int, *,
                  workspace: Workspace | None = None) -> torch.Tensor:
    """Each row's attention budget at alpha = 1: mass shares on sink, local and far keys (``AttentionBudget``).

    Parameters
    ----------
    shifted : Tensor, shape (kv_heads, group, rows, keys)
        Logits minus each row's largest, ``s_j = z_j - t0 <= 0``; ``-inf`` where hidden (read only).
    n_visible : LongTensor, shape (rows,)
        Visible keys per row (the first ``n``).
    total : Tensor, shape (kv_heads, group, rows)
        ``S(1) = sum_j exp(s_j)`` over the visible keys (``reduce_rows``'s sum at alpha = 1).
    sinks, window : int
        ``S`` and ``W`` of the key sets (``sharpdraft_theory.stats`` module docstring).
    workspace : Workspace, optional
        Scratch buffers to reuse.

    Returns
    -------
    Tensor, shape (kv_heads, group, rows, 3), fp32: shares on sink, local, far keys; each row sums to 1.

    Notes
    -----
    Only the sinks and the last ``min(W, keys)`` positions of each row are read (a gather, then
    one ``exp`` each, subnormals flushed on CPU as in ``distance_sums``): far mass is the rest,
    ``S(1) - sink - local``, taken as 0 where the far set is empty (``n <= S + W``) and clamped
    at 0 against round-off elsewhere. The three sums are divided by their own total, so the
    shares sum to 1 to fp32 rounding. Cost: ``S + min(W, keys)`` exponentials per row against
    ``reduce_rows``'s ``(P + Q) keys``.
    """
    ws = workspace if workspace is not None else Workspace()
    kvh, group, rows, keys = shifted.shape
    device = shifted.device
    span = min(window, keys)
    position = n_visible[:, None] - span + torch.arange(span, device=device)  # (R, span): each row's last keys
    local_keys = position >= sinks  # not a sink (this also drops the positions < 0 of rows shorter than W)
    with _flush_denormal(device):
        near = torch.gather(shifted, -1, position.clamp(min=0).expand(kvh, group, rows, span),
                            out=ws.take("budget", (kvh, group, rows, span), shifted.dtype, device))
        local = near.exp_().masked_fill_(~local_keys, 0.0).sum(-1, dtype=torch.float64)  # (KVH, G, R)
        sink = shifted[..., :sinks].exp().sum(-1, dtype=torch.float64)  # hidden sinks (n < S) are exp(-inf) = 0
    far = torch.where(n_visible > sinks + window, total - sink - local, 0.0).clamp_(min=0.0)
    parts = torch.stack([sink, local, far], -1)  # (KVH, G, R, 3)
    return (parts / parts.sum(-1, keepdim=True)).float()


@contextlib.contextmanager
def _flush_denormal(device: torch.device):
    """On CPU, flush subnormal floats to zero inside the block (``torch.set_flush_denormal``), then stop.

    Calibration runs with the default (off) everywhere else, which is what is restored.
    """
    if device.type != "cpu" or not torch.set_flush_denormal(True):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


@contextlib.contextmanager
def _cpu_threads(device: torch.device, threads: int):
    """Run the reduction's CPU ops on ``threads`` intra-op threads, then restore the setting.

    The reduction is many elementwise ops on 1e4-1e6 elements; OpenMP's fork/join per op costs
    more than it saves there, and on a loaded machine a descheduled worker stalls every op (we
    measured 2.9 s per SmolLM2 layer on 2 threads against 0.06 s on one). The model's forward,
    made of large matrix products, keeps all threads.
    """
    if device.type != "cpu" or torch.get_num_threads() <= threads:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class RowCollector:
    """An ``AttentionTap`` that keeps rows on the n grid and accumulates their statistics.

    Call ``start(seq)`` before each sequence, run the drafter with this object as its tap, then
    ``take()`` the sequence's ``RowStats``. Causal calls (``n_visible`` varies along the query)
    keep the rows whose ``n_visible`` is on ``grid``: one row per n per head in a prefill. A
    call whose queries all see the same keys is a non-causal block (DFlash places one block at
    each sampled position) and is kept whole.

    On CUDA each call's reduction is queued on a side stream after the forward's work so far,
    and the forward goes on; ``take()`` waits for it. The query and key tensors are marked as in
    use by that stream, so the allocator does not hand their memory to later layers too early;
    the forward must not change them in place after the call (no drafter here does).

    Parameters
    ----------
    grid : array of int
        Visible-key counts to keep (``log_grid``).
    k_max : int
        Top logits per row.
    alpha_grid : array
        Query scales for ``lse``; must contain 1.0.
    chunk : int, optional
        Query rows (per head) per chunk; default: as many as fit ``budget`` logits.
    budget : int
        Logits per chunk when ``chunk`` is not given.
    distance_alphas : array or None
        Query scales of the distance profile (``DistanceStats``; bins up to ``max(grid)``);
        None records none.
    budget_window : int or None
        W of the attention budget (``AttentionBudget``, with ``DEFAULT_SINKS`` sinks); None
        records none.
    """

    def __init__(self, grid, *, k_max: int = DEFAULT_K_MAX, alpha_grid=DEFAULT_ALPHA_GRID,
                 chunk: int | None = None, budget: int = DEFAULT_BUDGET, distance_alphas=DISTANCE_ALPHAS,
                 budget_window: int | None = None):
        self.grid = np.asarray(grid, dtype=np.int64)
        if self.grid.min() <= k_max:
            raise ValueError(f"every sampled n must exceed k_max={k_max}, got n={int(self.grid.min())}")
        self.k_max = k_max
        self.alpha_grid = np.asarray(alpha_grid, dtype=np.float64)
        self.lattice = alpha_lattice(self.alpha_grid)
        self.chunk = chunk
        self.budget = budget
        self.distance_alphas = None if distance_alphas is None else np.asarray(distance_alphas, dtype=np.float64)
        if self.distance_alphas is not None and \
                np.abs(self.alpha_grid[:, None] - self.distance_alphas).min(0).max() > 1e-6:
            raise ValueError("every distance alpha must lie on alpha_grid (reduce_rows reads its sums there)")
        self.edges = distance_edges(int(self.grid.max()))
        self.attention_budget = None if budget_window is None else (DEFAULT_SINKS, int(budget_window))
        self._on_device: dict[torch.device, tuple[torch.Tensor, AlphaLattice]] = {}
        self._distance_t: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._parts: list[dict] = []
        self._profile: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (batch, layer) -> sums, on the device
        self.seq = 0

    def start(self, seq: int) -> None:
        """Begin a sequence: rows collected from now on carry ``seq``."""
        self.seq = seq
        self._parts = []
        self._profile = {}

    @property
    def rows(self) -> int:
        """Rows collected since ``start``."""
        return sum(p["n"].shape[0] for p in self._parts)

    def __call__(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, scaling: float,
                 n_visible: torch.Tensor) -> None:
        with torch.no_grad(), _cpu_threads(query.device, _CPU_THREADS):
            batch, heads, q_len, head_dim = query.shape
            kv_heads = key.shape[1]
            group = heads // kv_heads
            grid_t, lattice = self._device_tensors(query.device)
            for b in range(batch):
                if q_len > 1 and bool((n_visible[b] == n_visible[b, 0]).all()):
                    keep = torch.arange(q_len, device=query.device)  # a non-causal block: all of it
                else:
                    keep = torch.isin(n_visible[b], grid_t).nonzero()[:, 0]  # query positions on the grid
                if keep.numel() == 0:
                    continue
                n_rows = n_visible[b, keep]
                order = torch.argsort(n_rows, stable=True)
                keep, n_rows = keep[order], n_rows[order]
                n_host = n_rows.cpu().numpy()  # chunk bounds, read here so the reduction never waits on the host
                q = query[b].reshape(kv_heads, group, -1, head_dim)  # (KVH, G, q_len, D); head = kvh * G + g
                with self._side_stream(query, key, keep, n_rows):
                    workspace = Workspace()  # this call's scratch memory, freed before the layer goes on
                    for lo, hi in self._chunks(n_host, heads):
                        out = reduce_rows(q[:, :, keep[lo:hi]], key[b, :, :int(n_host[hi - 1])], n_rows[lo:hi],
                                          scaling, k_max=self.k_max, alpha_grid=lattice, workspace=workspace,
                                          distance=self._distance_tensors(query.device),
                                          attention_budget=self.attention_budget)
                        self._add_profile(layer_idx, b, out.pop("distance", None), heads)
                        self._store(layer_idx, b, n_rows[lo:hi], out, heads)

    def take(self) -> RowStats:
        """The rows of the current sequence, as float32 ``RowStats`` (layer-major order)."""
        for stream in self._streams.values():
            stream.synchronize()
        if not self._parts:
            raise UserError("the drafter produced no attention rows on the sampled lengths; "
                            "is --max-length larger than the shortest sampled n (32)?")
        parts, self._parts = self._parts, []
        host = []
        for part in parts:
            flat = {k: v.cpu().numpy() if isinstance(v, torch.Tensor) else v for k, v in part.items()}
            if not (np.isfinite(flat["top"]).all() and np.isfinite(flat["lse"]).all()
                    and np.isfinite(flat["var"]).all()):
                raise UserError(f"non-finite attention logits in layer {int(flat['layer'][0])} of sequence "
                                f"{int(flat['seq'][0])}: the drafter's activations overflow in this dtype; "
                                "try --dtype float32")
            host.append(flat)
        cat = {k: np.concatenate([p[k] for p in host]) for k in host[0]}
        budget = None
        if self.attention_budget is not None:
            sinks, window = self.attention_budget
            budget = AttentionBudget(sinks=sinks, window=window, share=cat.pop("budget"))
        return RowStats(alpha_grid=self.alpha_grid, distance=self._take_profile(), budget=budget, **cat)

    # -- internals ---------------------------------------------------------------------------
    def _device_tensors(self, device: torch.device) -> tuple[torch.Tensor, AlphaLattice]:
        """The n grid and the alpha lattice on ``device`` (copied there once)."""
        if device not in self._on_device:
            lattice = self.lattice
            self._on_device[device] = (torch.as_tensor(self.grid, device=device),
                                       replace(lattice, values=lattice.values.to(device), base=lattice.base.to(device),
                                               step=lattice.step.to(device), index=lattice.index.to(device)))
        return self._on_device[device]

    @contextlib.contextmanager
    def _side_stream(self, *tensors: torch.Tensor):
        """On CUDA, run the block on this collector's side stream after the work queued so far.

        ``tensors`` (made by the forward's stream, read by the block) are marked as in use by the
        side stream, so their memory is not reused before the block's work is done.
        """
        device = tensors[0].device
        if device.type != "cuda":
            yield
            return
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        stream = self._streams[device]
        stream.wait_stream(torch.cuda.current_stream(device))
        for tensor in tensors:
            tensor.record_stream(stream)
        with torch.cuda.stream(stream):
            yield

    def _distance_tensors(self, device: torch.device):
        if self.distance_alphas is None:
            return None
        if device not in self._distance_t:
            self._distance_t[device] = (torch.as_tensor(self.edges, device=device), tuple(self.distance_alphas))
        return self._distance_t[device]

    def _add_profile(self, layer_idx: int, b: int, sums: dict | None, heads: int) -> None:
        """Add one chunk's ``distance_sums`` to the sequence's (batch, layer) totals, per head.

        The totals stay where they were computed (on CUDA, summed on the side stream); ``take``
        brings them to the host with the rows.
        """
        if sums is None:
            return
        flat = {k: v.reshape(heads, *v.shape[2:]) for k, v in sums.items()}  # (KVH, G, ...) -> (H, ...)
        total = self._profile.get((b, layer_idx))
        if total is None:
            self._profile[(b, layer_idx)] = flat
        else:
            for k, v in flat.items():
                total[k] += v

    def _take_profile(self) -> DistanceStats | None:
        """The sequence's ``DistanceStats``: (batches, layers, heads, ...) from the (batch, layer) totals."""
        if not self._profile:
            return None
        profile, self._profile = self._profile, {}
        batches = max(b for b, _ in profile) + 1
        layers = max(layer for _, layer in profile) + 1
        out = {k: np.zeros((batches, layers) + v.shape) for k, v in next(iter(profile.values())).items()}
        for (b, layer), sums in profile.items():
            for k, v in sums.items():
                out[k][b, layer] = v.cpu().numpy()  # (H, ...) of this batch row and layer
        return DistanceStats(seq=self.seq + np.arange(batches), alpha=self.distance_alphas, edges=self.edges, **out)

    def _chunks(self, n_rows: np.ndarray, heads: int):
        """Split sorted rows into chunks spanning at most 1.5x in n and within the logit budget."""
        lo = 0
        while lo < n_rows.size:
            hi = lo + 1
            while hi < n_rows.size and n_rows[hi] <= 1.5 * n_rows[lo] and self._fits(hi - lo + 1, n_rows[hi], heads):
                hi += 1
            yield lo, hi
            lo = hi

    def _fits(self, rows: int, n_max: int, heads: int) -> bool:
        if self.chunk is not None:
            return rows <= self.chunk
        return rows * heads * int(n_max) <= self.budget

    def _store(self, layer_idx: int, b: int, n_chunk: torch.Tensor, out: dict, heads: int) -> None:
        """Keep a chunk's statistics where they were computed; ``take`` brings them to the host."""
        rows = n_chunk.numel()
        # (KVH, G, R, ...) -> (H * R, ...), head-major within the chunk.
        flat = {k: v.reshape(heads * rows, *v.shape[3:]).float() for k, v in out.items()}
        flat["n"] = n_chunk.repeat(heads).long()
        flat["head"] = np.repeat(np.arange(heads, dtype=np.int32), rows)
        flat["layer"] = np.full(heads * rows, layer_idx, dtype=np.int32)
        flat["seq"] = np.full(heads * rows, self.seq + b, dtype=np.int32)
        self._parts.append(flat)
