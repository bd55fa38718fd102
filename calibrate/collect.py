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

``row_stats_from_logits`` in ``sharpdraft_theory.stats`` is the float64 numpy version of the
same reduction; the tests hold this one to it.

Memory: a chunk holds at most ``budget`` logits (plus a few same-sized temporaries), so the
extra memory of calibration is bounded whatever the sequence length. Rows are grouped by
``n`` (at most 1.5x apart) so a chunk's key range is cut at its longest row, and short rows do not pay
for long ones.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from sharpdraft_theory.stats import DEFAULT_ALPHA_GRID, RowStats

from .errors import UserError

__all__ = ["log_grid", "reduce_rows", "RowCollector", "DEFAULT_K_MAX", "DEFAULT_BUDGET"]

DEFAULT_K_MAX = 16  # top logits kept per row: any --top-k up to this can be fitted later
DEFAULT_BUDGET = 1 << 19  # logits per chunk (2 MiB in fp32, about 6x that in temporaries); --chunk: rows
_CPU_THREADS = 1  # intra-op threads of the reduction on CPU (see _cpu_threads)
_RESTART = 32  # fresh exp every this many alpha-grid steps (see reduce_rows)


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


def reduce_rows(query: torch.Tensor, key: torch.Tensor, n_visible: torch.Tensor, scaling: float, *,
                k_max: int, alpha_grid) -> dict[str, torch.Tensor]:
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
    alpha_grid : sequence of float, increasing, all > 0
        Query scales for ``lse``.

    Returns
    -------
    dict of fp32 tensors with leading shape (kv_heads, group, rows): ``top`` (.., k_max),
    ``lse`` (.., n_alpha), ``tilted_mean``, ``mean``, ``var``.

    Notes
    -----
    With ``s_j = z_j - max z`` (so ``s_j <= 0``), ``lse(a) = a max z + ln sum_j e^{a s_j}``. The
    terms ``e^{a s_j}`` are stepped along the grid by multiplication,
    ``e^{a' s} = e^{a s} e^{(a' - a) s}``, with one ``exp`` per distinct step and a fresh ``exp``
    every ``_RESTART`` steps to bound the rounding drift (about 1e-6 relative): a ``logsumexp``
    per grid value costs several passes and an ``exp`` each, which made the reduction slower than
    the forward pass itself. Mean and variance come from sums over all keys with the hidden
    ones at ``s = 0``, corrected exactly for them.
    """
    keys = key.shape[1]
    grid = [float(a) for a in alpha_grid]
    logits = torch.matmul(query.float(), key.float().transpose(-1, -2)[:, None])  # (KVH, G, R, N)
    logits.mul_(scaling)
    hidden = torch.arange(keys, device=key.device) >= n_visible[:, None]  # (R, N)
    logits.masked_fill_(hidden, float("-inf"))
    top = torch.topk(logits, k_max, dim=-1).values  # (KVH, G, R, k_max), descending
    peak = top[..., :1]
    shifted = logits.sub_(peak)  # s_j <= 0; -inf where hidden
    zeroed = shifted.masked_fill(hidden, 0.0)
    n = n_visible.to(torch.float32)
    mean_s = zeroed.sum(-1) / n
    var = zeroed.square().sum(-1, dtype=torch.float64) / n - mean_s.double() ** 2

    one = min(range(len(grid)), key=lambda k: abs(grid[k] - 1.0))
    if abs(grid[one] - 1.0) > 1e-6:
        raise ValueError("alpha_grid must contain 1.0")
    sums, steps = [], {}
    for k, a in enumerate(grid):
        if k % _RESTART == 0:
            terms = torch.exp(shifted * a)
        else:
            step = round(a - grid[k - 1], 9)
            if step not in steps:
                steps[step] = torch.exp(shifted * step)
            terms.mul_(steps[step])
        sums.append(terms.sum(-1))
        if k == one:
            tilted = peak[..., 0] + (terms * zeroed).sum(-1) / sums[-1]
    lse = torch.stack(sums, dim=-1).log_() + peak * torch.tensor(grid, device=peak.device)
    return dict(top=top, lse=lse, tilted_mean=tilted, mean=peak[..., 0] + mean_s,
                var=var.clamp_(min=0.0).float())


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
    """

    def __init__(self, grid, *, k_max: int = DEFAULT_K_MAX, alpha_grid=DEFAULT_ALPHA_GRID,
                 chunk: int | None = None, budget: int = DEFAULT_BUDGET):
        self.grid = np.asarray(grid, dtype=np.int64)
        if self.grid.min() <= k_max:
            raise ValueError(f"every sampled n must exceed k_max={k_max}, got n={int(self.grid.min())}")
        self.k_max = k_max
        self.alpha_grid = np.asarray(alpha_grid, dtype=np.float64)
        self.chunk = chunk
        self.budget = budget
        self._grid_t: dict[torch.device, torch.Tensor] = {}
        self._parts: list[dict[str, np.ndarray]] = []
        self.seq = 0

    def start(self, seq: int) -> None:
        """Begin a sequence: rows collected from now on carry ``seq``."""
        self.seq = seq
        self._parts = []

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
            grid_t = self._device_tensors(query.device)
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
                q = query[b].reshape(kv_heads, group, -1, head_dim)  # (KVH, G, q_len, D); head = kvh * G + g
                for lo, hi in self._chunks(n_rows.cpu().numpy(), heads):
                    n_chunk = n_rows[lo:hi]
                    n_max = int(n_chunk[-1])
                    out = reduce_rows(q[:, :, keep[lo:hi]], key[b, :, :n_max], n_chunk, scaling,
                                      k_max=self.k_max, alpha_grid=self.alpha_grid)
                    self._store(layer_idx, b, n_chunk, out, heads)

    def take(self) -> RowStats:
        """The rows of the current sequence, as float32 ``RowStats`` (layer-major order)."""
        if not self._parts:
            raise UserError("the drafter produced no attention rows on the sampled lengths; "
                            "is --max-length larger than the shortest sampled n (32)?")
        cat = {k: np.concatenate([p[k] for p in self._parts]) for k in self._parts[0]}
        self._parts = []
        return RowStats(alpha_grid=self.alpha_grid, **cat)

    # -- internals ---------------------------------------------------------------------------
    def _device_tensors(self, device: torch.device):
        if device not in self._grid_t:
            self._grid_t[device] = torch.as_tensor(self.grid, device=device)
        return self._grid_t[device]

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
        top = out["top"]
        if not (torch.isfinite(top).all() and torch.isfinite(out["lse"]).all() and torch.isfinite(out["var"]).all()):
            raise UserError(f"non-finite attention logits in layer {layer_idx} of sequence {self.seq}: "
                            "the drafter's activations overflow in this dtype; try --dtype float32")
        rows = n_chunk.numel()
        # (KVH, G, R, ...) -> (H * R, ...), head-major within the chunk.
        flat = {k: v.reshape(heads * rows, *v.shape[3:]).cpu().numpy().astype(np.float32) for k, v in out.items()}
        n = n_chunk.cpu().numpy().astype(np.int64)
        flat["n"] = np.tile(n, heads)
        flat["head"] = np.repeat(np.arange(heads, dtype=np.int32), rows)
        flat["layer"] = np.full(heads * rows, layer_idx, dtype=np.int32)
        flat["seq"] = np.full(heads * rows, self.seq + b, dtype=np.int32)
        self._parts.append(flat)
