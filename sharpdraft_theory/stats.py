"""Per-row sufficient statistics of attention logits, the input of every slope estimator.

Calibration never keeps whole attention rows. For each sampled row (one query of one head of one
layer, seeing ``n`` keys) it keeps:

==============  ===================  ==========================================================
field           shape                meaning
==============  ===================  ==========================================================
n               (rows,)              visible keys
layer, head     (rows,)              where the row comes from
seq             (rows,)              which sequence: the bootstrap's unit (see ``concat``)
top             (rows, k_max)        the k_max largest logits, descending
alpha_grid      (n_alpha,)           query scales; must contain 1.0
lse             (rows, n_alpha)      ``LSE_j(a z_j)`` over all visible keys, for each grid a
tilted_mean     (rows,)              ``sum z e^z / sum e^z`` over all keys (a = 1)
mean, var       (rows,)              plain mean and population variance of all visible logits
distance        (per sequence)       optional ``DistanceStats``: the background's distance profile
budget          (rows, 3)            optional ``AttentionBudget``: mass on sink, local, far keys
==============  ===================  ==========================================================

From these, the top-k mass ``M_k(a)`` is exact for every ``k <= k_max`` and grid ``a``::

    ln S_T(a) = LSE(a top[:k]),   ln S_B(a) = lse(a) + log1p(-exp(ln S_T(a) - lse(a)))

and the background's tilted mean, plain mean and variance follow by removing the top set.

``DistanceStats`` (theory.md section 8, ``sharpdraft_theory.distance``) sums, per (sequence,
layer, head), over all rows of the sequence, with ``t0`` the row's largest logit and the distance
of key ``j`` in a row of ``n`` keys ``d = n - j`` (the query's own key at 1, the sink at ``n``):

==============  ===================  ==========================================================
field           shape                meaning
==============  ===================  ==========================================================
seq             (S,)                 sequence ids (the bootstrap's unit)
alpha           (A,)                 query scales of the profile (``DISTANCE_ALPHAS``)
edges           (B + 1,)             distance bins ``edges[b] <= d < edges[b + 1]``
weight          (S, L, H, B, A)      ``sum exp(a (z_j - t0))`` over background keys in bin b
keys            (S, L, H, B)         how many background keys that sum holds
sink            (S, L, H, A)         ``sum exp(a z_0) / sum_j exp(a z_j)``: the sink's share
rows            (S, L, H)            rows summed
==============  ===================  ==========================================================

Background keys are all but the sink (position 0) and the row's ``k_max`` largest logits. Sums
of weights ``<= 1``, aggregated over rows, keep the memory independent of the row count.

``AttentionBudget`` says where each row's attention goes at alpha = 1 (the unscaled attention),
one entry per row of the ``RowStats`` it belongs to. With ``p_j = e^{z_j} / sum_i e^{z_i}`` over a
row's visible keys ``j = 0 .. n - 1``, ``S`` sinks and a window of ``W`` keys, the three disjoint
sets, sinks first, then the window, the rest far, are::

    sink   j < S                       the sequence's first keys (StreamingLLM's attention sinks)
    local  max(S, n - W) <= j < n      the last W visible keys that are not sinks
    far    S <= j < n - W              everything else (empty while n <= S + W)

and ``share = (sum_sink p, sum_local p, sum_far p)`` sums to 1. A row of ``n <= S`` keys is all
sink. Mass draining from the top set into a growing far set is dilution (query scaling counters
it); mass drifting away from the sinks and the window is drift (a sliding window with sinks
counters it).
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass, fields

import numpy as np
from scipy.special import logsumexp

from .atomic import atomic_path

__all__ = ["RowStats", "DistanceStats", "AttentionBudget", "row_stats_from_logits", "budget_from_logits",
           "distance_edges", "DEFAULT_ALPHA_GRID", "DISTANCE_ALPHAS", "DEFAULT_SINKS", "BUDGET_PARTS"]

#: Background mass share below which float32 statistics cannot resolve the background's tilted mean.
UNRESOLVED_SHARE = 1e-3

#: Default grid of query scales at which calibration records ``lse``: fine near 1, up to 4.
DEFAULT_ALPHA_GRID = np.round(np.concatenate([np.arange(0.5, 2.0, 0.025), np.arange(2.0, 4.0001, 0.05)]), 6)


#: Query scales at which calibration records the distance profile: a subset of the default grid.
DISTANCE_ALPHAS = np.array([0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0])


#: Sink keys: the first 4 of the sequence, as StreamingLLM keeps (the budget's sinks, eval's sinks baseline).
DEFAULT_SINKS = 4

#: The attention budget's key sets, in the order of ``AttentionBudget.share``'s columns.
BUDGET_PARTS = ("sink", "local", "far")


def distance_edges(max_length: int, per_octave: int = 4) -> np.ndarray:
    """Log-spaced distance bin edges covering ``1 <= d <= max_length``: ``per_octave`` per doubling.

    >>> distance_edges(20).tolist()
    [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 13, 16, 19, 21]
    """
    steps = np.arange(0, int(np.ceil(per_octave * np.log2(max(max_length, 1)))) + 1)
    edges = np.unique(np.round(2.0 ** (steps / per_octave)).astype(np.int64))
    return np.append(edges[edges <= max_length], max_length + 1)


@dataclass(frozen=True, eq=False)
class DistanceStats:
    """Distance profile of the background per (sequence, layer, head): see the module docstring."""

    seq: np.ndarray  # (S,) sequence ids
    alpha: np.ndarray  # (A,) query scales
    edges: np.ndarray  # (B + 1,) distance bin edges
    weight: np.ndarray  # (S, L, H, B, A) summed exp(a (z - t0)) of background keys per bin
    keys: np.ndarray  # (S, L, H, B) background keys summed per bin
    sink: np.ndarray  # (S, L, H, A) summed share of the sink in each row's mass
    rows: np.ndarray  # (S, L, H) rows summed

    def __post_init__(self):
        for f in fields(self):
            object.__setattr__(self, f.name, np.asarray(getattr(self, f.name)))
        s, a, b = self.seq.size, self.alpha.size, self.edges.size - 1
        lh = self.rows.shape[1:] if self.rows.ndim == 3 else None
        if lh is None or self.rows.shape[0] != s or self.weight.shape != (s, *lh, b, a) \
                or self.keys.shape != (s, *lh, b) or self.sink.shape != (s, *lh, a):
            raise ValueError(f"DistanceStats: inconsistent shapes (seq {self.seq.shape}, alpha {self.alpha.shape}, "
                             f"edges {self.edges.shape}, weight {self.weight.shape}, keys {self.keys.shape}, "
                             f"sink {self.sink.shape}, rows {self.rows.shape})")

    @classmethod
    def concat(cls, parts: list["DistanceStats"], seqs: list[np.ndarray] | None = None) -> "DistanceStats":
        """Join along sequences (``seqs``: new ids per part; layers and heads are padded to the largest).

        A sequence id held by several parts (one run's sequence split across files, e.g. by
        layer) is one sequence: its sums are added, at its first place.
        """
        first = parts[0]
        for p in parts[1:]:
            if not (np.array_equal(p.alpha, first.alpha) and np.array_equal(p.edges, first.edges)):
                raise ValueError("distance statistics to join were recorded on different alpha grids or distance bins")
        layers = max(p.rows.shape[1] for p in parts)
        heads = max(p.rows.shape[2] for p in parts)

        def pad(x):
            return np.pad(x, [(0, 0), (0, layers - x.shape[1]), (0, heads - x.shape[2])] + [(0, 0)] * (x.ndim - 3))

        ids = np.concatenate(seqs if seqs is not None else [p.seq for p in parts])
        sums = {name: np.concatenate([pad(getattr(p, name)) for p in parts]) for name in ("weight", "keys", "sink", "rows")}
        unique, first_at, slot = np.unique(ids, return_index=True, return_inverse=True)
        if unique.size < ids.size:  # merge repeated ids, in order of first appearance
            order = np.argsort(first_at, kind="stable")
            rank = np.empty_like(order)
            rank[order] = np.arange(order.size)
            merged = {}
            for name, value in sums.items():
                merged[name] = np.zeros((unique.size,) + value.shape[1:], dtype=value.dtype)
                np.add.at(merged[name], rank[slot], value)
            ids, sums = unique[order], merged
        return cls(seq=ids, alpha=first.alpha, edges=first.edges, **sums)


@dataclass(frozen=True, eq=False)
class AttentionBudget:
    """Each row's attention mass on sink, local and far keys at alpha = 1: see the module docstring."""

    sinks: int  # S: the sequence's first S keys are the sinks
    window: int  # W: the last W visible keys are local (calibration takes n_ref)
    share: np.ndarray  # (rows, 3) mass shares on the sets of BUDGET_PARTS; each row sums to 1

    def __post_init__(self):
        object.__setattr__(self, "sinks", int(self.sinks))
        object.__setattr__(self, "window", int(self.window))
        object.__setattr__(self, "share", np.asarray(self.share))
        if self.sinks < 0 or self.window < 1:
            raise ValueError(f"AttentionBudget: sinks must be >= 0 and window >= 1, got {self.sinks} and {self.window}")
        if self.share.ndim != 2 or self.share.shape[1] != len(BUDGET_PARTS) or not np.all(np.isfinite(self.share)):
            raise ValueError(f"AttentionBudget.share must be finite, (rows, {len(BUDGET_PARTS)}), "
                             f"got shape {self.share.shape}")

    @property
    def rows(self) -> int:
        return int(self.share.shape[0])

    def select(self, mask) -> "AttentionBudget":
        """The rows where ``mask`` is True (or at the given indices)."""
        return AttentionBudget(sinks=self.sinks, window=self.window, share=self.share[mask])

    @classmethod
    def concat(cls, parts: list["AttentionBudget"]) -> "AttentionBudget":
        """Join the rows of parts taken with the same sinks and window."""
        first = parts[0]
        for p in parts[1:]:
            if (p.sinks, p.window) != (first.sinks, first.window):
                raise ValueError(f"attention budgets to join were taken with different sinks and windows "
                                 f"({first.sinks}, {first.window} and {p.sinks}, {p.window})")
        return cls(sinks=first.sinks, window=first.window, share=np.concatenate([p.share for p in parts]))


@dataclass(frozen=True, eq=False)
class RowStats:
    n: np.ndarray
    layer: np.ndarray
    head: np.ndarray
    seq: np.ndarray
    top: np.ndarray
    alpha_grid: np.ndarray
    lse: np.ndarray
    tilted_mean: np.ndarray
    mean: np.ndarray
    var: np.ndarray
    distance: DistanceStats | None = None  # per-sequence distance profile (kept whole by ``select``)
    budget: AttentionBudget | None = None  # per-row sink / local / far mass shares (selected with the rows)

    def __post_init__(self):
        object.__setattr__(self, "_log_top_cache", {})
        rows = np.shape(self.n)[0] if np.ndim(self.n) else -1
        if self.distance is not None and not isinstance(self.distance, DistanceStats):
            raise ValueError("RowStats.distance must be DistanceStats or None")
        if self.budget is not None and (not isinstance(self.budget, AttentionBudget) or self.budget.rows != rows):
            raise ValueError(f"RowStats.budget must be an AttentionBudget of {rows} rows or None")
        for f in _row_fields():
            value = np.asarray(getattr(self, f.name))
            object.__setattr__(self, f.name, value)
            if f.name != "alpha_grid" and (value.ndim == 0 or value.shape[0] != rows):
                raise ValueError(f"RowStats.{f.name}: expected {rows} rows, got shape {value.shape}")
        if self.top.ndim != 2 or self.lse.shape != (rows, self.alpha_grid.size):
            raise ValueError(f"RowStats: top must be (rows, k_max) and lse (rows, {self.alpha_grid.size}), "
                             f"got {self.top.shape} and {self.lse.shape}")
        if not np.any(np.isclose(self.alpha_grid, 1.0)):
            raise ValueError("RowStats.alpha_grid must contain 1.0")
        for name in ("top", "lse", "tilted_mean", "mean", "var"):
            if not np.all(np.isfinite(getattr(self, name))):
                raise ValueError(f"RowStats.{name} holds NaN or inf: the drafter produced non-finite logits")

    @property
    def rows(self) -> int:
        return int(self.n.shape[0])

    @property
    def k_max(self) -> int:
        return int(self.top.shape[1])

    @property
    def index_of_one(self) -> int:
        return int(np.argmin(np.abs(self.alpha_grid - 1.0)))

    def select(self, mask) -> "RowStats":
        """The rows where ``mask`` is True (or at the given indices); ``distance`` is kept whole."""
        return RowStats(distance=self.distance, budget=None if self.budget is None else self.budget.select(mask),
                        **{f.name: getattr(self, f.name) if f.name == "alpha_grid" else getattr(self, f.name)[mask]
                           for f in _row_fields()})

    # -- derived quantities (float64) --------------------------------------------------------
    def log_top(self, top_k: int) -> np.ndarray:
        """``ln S_T(a)`` for every row and grid a: (rows, n_alpha). Cached per ``top_k``.

        ``top`` is sorted descending, so the largest term of ``a * top`` is ``a * top[0]`` for
        ``a >= 0`` and ``a * top[k-1]`` otherwise; the sum is taken relative to it.
        """
        if top_k not in self._log_top_cache:
            self._check_k(top_k)
            top = self.top[:, :top_k].astype(np.float64)  # (rows, k)
            a = self.alpha_grid[None, :, None]  # (1, n_alpha, 1)
            lead = np.where(a >= 0, top[:, None, :1], top[:, None, -1:])  # (rows, n_alpha, 1)
            rel = np.exp(a * (top[:, None, :] - lead)).sum(axis=-1)  # (rows, n_alpha), in [1, k]
            self._log_top_cache[top_k] = a[..., 0] * lead[..., 0] + np.log(rel)
        return self._log_top_cache[top_k]

    def mass(self, top_k: int) -> np.ndarray:
        """Top-k mass ``M_k(a)`` for every row and grid a: (rows, n_alpha)."""
        return np.minimum(np.exp(self.log_top(top_k) - self.lse.astype(np.float64)), 1.0)

    def background_log_sum(self, top_k: int) -> np.ndarray:
        """``ln S_B(1)`` per row."""
        i = self.index_of_one
        log_t = self.log_top(top_k)[:, i]
        lse = self.lse[:, i].astype(np.float64)
        return lse + np.log1p(-np.minimum(np.exp(log_t - lse), 1.0 - 1e-15))

    def tilted_means(self, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(zbar_T(1), zbar_B(1))`` per row: tilted means of top set and background at a = 1.

        ``zbar_B = (zbar_all - M zbar_T) / (1 - M)`` divides by the background's share of the
        mass. Calibration records statistics in float32, so where ``1 - M < UNRESOLVED_SHARE``
        (attention-sink rows with nearly all mass on the top set) the quotient is round-off;
        ``zbar_B`` is NaN there.
        """
        top = self.top[:, :top_k].astype(np.float64)
        w = np.exp(top - logsumexp(top, axis=1, keepdims=True))
        zbar_t = np.sum(w * top, axis=1)
        share = 1.0 - self.mass(top_k)[:, self.index_of_one]
        resolved = share >= UNRESOLVED_SHARE
        zbar_b = (self.tilted_mean - (1.0 - share) * zbar_t) / np.where(resolved, share, 1.0)
        return zbar_t, np.where(resolved, zbar_b, np.nan)

    def background_moments(self, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        """Plain mean and population variance of the background logits (top set removed)."""
        self._check_k(top_k)
        n = self.n.astype(np.float64)
        top = self.top[:, :top_k].astype(np.float64)
        nb = n - top_k
        total = self.mean * n
        total_sq = (self.var + self.mean.astype(np.float64) ** 2) * n
        mean_b = (total - top.sum(axis=1)) / nb
        var_b = (total_sq - np.sum(top**2, axis=1)) / nb - mean_b**2
        return mean_b, np.maximum(var_b, 0.0)

    def _check_k(self, top_k: int) -> None:
        if not 1 <= top_k <= self.k_max:
            raise ValueError(f"top_k={top_k} must be between 1 and k_max={self.k_max} of these statistics")
        if np.any(self.n <= top_k):
            raise ValueError(f"top_k={top_k} leaves no background in rows with n <= {top_k}")

    # -- I/O ---------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, **meta) -> None:
        """Write the statistics (and string metadata) atomically as ``.npz``."""
        dist = {} if self.distance is None else {f"distance_{f.name}": getattr(self.distance, f.name)
                                                 for f in fields(DistanceStats)}
        budget = {} if self.budget is None else {f"budget_{f.name}": getattr(self.budget, f.name)
                                                 for f in fields(AttentionBudget)}
        with atomic_path(path, suffix=".npz") as tmp:
            np.savez_compressed(tmp, **{f.name: getattr(self, f.name) for f in _row_fields()}, **dist, **budget,
                                **{f"meta_{k}": np.asarray(str(v)) for k, v in meta.items()})

    @classmethod
    def load(cls, path: str | os.PathLike) -> tuple["RowStats", dict]:
        """Read a statistics file; returns the rows and the metadata.

        Any problem (no such file, not an .npz archive, truncated, arrays missing or malformed) is a
        one-line ``ValueError`` naming the file.
        """
        where = f"statistics file {str(path)!r}"
        again = "write it again with `sharpdraft calibrate --stats FILE`"
        if os.path.isfile(path) and not zipfile.is_zipfile(path):
            with open(path, "rb") as f:
                begins_as_zip = f.read(4) == b"PK\x03\x04"
            if begins_as_zip:  # a zip's index is at its end: a cut-off copy or write starts right but has none
                raise ValueError(f"{where} is an incomplete .npz archive (its end is missing: an interrupted copy "
                                 f"or write?); copy it again, or {again}")
            raise ValueError(f"{where} is not an .npz archive; pass the file `sharpdraft calibrate --stats FILE` "
                             "wrote")
        try:
            with np.load(path, allow_pickle=False) as data:
                held = data.files
                missing = [f.name for f in _row_fields() if f.name not in held]
                if not missing:
                    distance = None
                    if "distance_weight" in held:
                        distance = DistanceStats(**{f.name: data[f"distance_{f.name}"] for f in fields(DistanceStats)})
                    budget = None  # files written before the budget was collected hold none
                    if "budget_share" in held:
                        budget = AttentionBudget(**{f.name: data[f"budget_{f.name}"]
                                                    for f in fields(AttentionBudget)})
                    stats = cls(distance=distance, budget=budget, **{f.name: data[f.name] for f in _row_fields()})
                    meta = {k[5:]: str(data[k]) for k in held if k.startswith("meta_")}
        except KeyError as err:
            raise ValueError(f"{where} cannot be read: {err.args[0]}; {again}") from None
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
            raise ValueError(f"{where} cannot be read ({err}); it may be truncated: {again}") from None
        if missing:
            raise ValueError(f"{where} has no array {missing[0]!r} (it holds {', '.join(held) or 'none'}): not a "
                             f"statistics file, or one from another version; {again}")
        return stats, meta

    @classmethod
    def concat(cls, parts: list["RowStats"], *, separate_runs: bool = False) -> "RowStats":
        """Join statistics (same alpha grid and k_max), keeping sequences of different runs apart.

        Sequence ids are the bootstrap's unit, so two rows share an id only if they come from one
        sequence. The rule:

        * ``separate_runs=False`` (default): the parts come from one run and share its numbering
          (its sequences, shards, layers or lengths, as calibration writes them); ids are kept, and
          a sequence may span parts. Two parts holding the same row key (seq, layer, head, n) are
          refused: that is what two runs numbered from 0 look like.
        * ``separate_runs=True``: each part is a run of its own. The first keeps its ids; each
          later part is shifted so that its smallest id is one past the largest id so far. Order
          and gaps within a part are kept, and no two parts share a sequence.

        Examples
        --------
        >>> import numpy as np
        >>> run = row_stats_from_logits(np.arange(12.0).reshape(2, 6), k_max=2, seq=[0, 1])
        >>> RowStats.concat([run, run], separate_runs=True).seq.tolist()
        [0, 1, 2, 3]
        """
        if not parts:
            raise ValueError("no statistics to join")
        grid = parts[0].alpha_grid
        for p in parts[1:]:
            if p.alpha_grid.shape != grid.shape or not np.allclose(p.alpha_grid, grid):
                raise ValueError("statistics to join were recorded on different alpha grids")
            if p.k_max != parts[0].k_max:
                raise ValueError(f"statistics to join have different k_max ({parts[0].k_max} and {p.k_max})")
        with_distance = all(p.distance is not None for p in parts)
        shifts = [0] * len(parts)
        if separate_runs:  # a part's ids are its rows' and, when joined, its profile's (``select`` keeps it whole)
            next_id = None
            for i, p in enumerate(parts):
                ids = np.concatenate([p.seq, p.distance.seq] if with_distance else [p.seq]).astype(np.int64)
                if ids.size:
                    if next_id is not None:
                        shifts[i] = next_id - int(ids.min())
                    next_id = int(ids.max()) + shifts[i] + 1
        else:
            _check_rows_distinct(parts)
        seqs = [p.seq.astype(np.int64) + d if separate_runs else p.seq for p, d in zip(parts, shifts)]
        joined = {f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in _row_fields()
                  if f.name not in ("alpha_grid", "seq")}
        distance = None
        if with_distance:  # each part's profile moves with its rows' ids (parts without one: no profile)
            distance = DistanceStats.concat([p.distance for p in parts],
                                            [p.distance.seq + d for p, d in zip(parts, shifts)])
        budget = None
        if all(p.budget is not None for p in parts):  # as the rows (parts without one: no budget)
            budget = AttentionBudget.concat([p.budget for p in parts])
        return cls(alpha_grid=grid, seq=np.concatenate(seqs), distance=distance, budget=budget, **joined)


def _row_fields():
    """RowStats' plain array fields: the per-row ones and ``alpha_grid`` (not ``distance``, ``budget``)."""
    return [f for f in fields(RowStats) if f.name not in ("distance", "budget")]


def _check_rows_distinct(parts: list[RowStats]) -> None:
    """Refuse parts of one run that hold the same (seq, layer, head, n) row key (see ``RowStats.concat``)."""
    if len(parts) < 2 or not any(p.rows for p in parts):
        return
    cols = [np.concatenate([getattr(p, name) for p in parts]).astype(np.int64) for name in ("seq", "layer", "head", "n")]
    low = [int(c.min()) for c in cols]
    dims = [int(c.max()) - lo + 1 for c, lo in zip(cols, low)]
    code = np.ravel_multi_index([c - lo for c, lo in zip(cols, low)], dims)  # one int64 per row key
    bounds = np.cumsum([0] + [p.rows for p in parts])
    codes = np.sort(np.concatenate([np.unique(code[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]))
    twice = np.flatnonzero(codes[1:] == codes[:-1])
    if twice.size:
        seq, layer, head, n = (int(i) + lo for i, lo in zip(np.unravel_index(codes[twice[0]], dims), low))
        raise ValueError(f"statistics to join hold the same row twice (sequence {seq}, layer {layer}, head {head}, "
                         f"n {n}): parts of separate runs share sequence ids; join them with separate_runs=True")


def budget_from_logits(logits, *, window: int, sinks: int = DEFAULT_SINKS) -> np.ndarray:
    """Attention budget of whole rows (float64 reference): ``(rows, 3)`` shares on sink, local, far keys.

    Each row's visible keys are its first ``n`` (``-inf`` after them); the key sets are the module
    docstring's, with ``S = sinks`` and ``W = window``.

    Examples
    --------
    >>> budget_from_logits([[0.0] * 8, [0.0] * 2 + [-np.inf] * 6], window=2, sinks=2).tolist()
    [[0.25, 0.25, 0.5], [1.0, 0.0, 0.0]]
    """
    z = np.atleast_2d(np.asarray(logits, dtype=np.float64))  # (rows, keys)
    finite = np.isfinite(z)
    n = finite.sum(axis=1)  # (rows,)
    j = np.arange(z.shape[1])
    if np.any(n < 1) or np.any(finite != (j[None, :] < n[:, None])):
        raise ValueError("the budget needs each row's visible keys first, at least one per row")
    p = np.exp(z - z.max(axis=1, keepdims=True))  # (rows, keys); 0 where not visible
    p /= p.sum(axis=1, keepdims=True)
    sink = j[None, :] < sinks
    local = ~sink & (j[None, :] >= n[:, None] - window)
    return np.stack([np.where(part, p, 0.0).sum(axis=1) for part in (sink, local, ~sink & ~local)], axis=1)


def row_stats_from_logits(logits, *, k_max: int, alpha_grid=DEFAULT_ALPHA_GRID, layer=0, head=0, seq=0,
                          edges=None, distance_alphas=DISTANCE_ALPHAS, window: int | None = None,
                          sinks: int = DEFAULT_SINKS) -> RowStats:
    """Reference (float64, numpy) reduction of whole rows to statistics; ``-inf`` = not visible.

    Calibration computes the same quantities in torch chunk by chunk; this is the plain-math
    version its tests compare against, and the way to build statistics for synthetic rows.
    With ``edges`` (``distance_edges``) it also records the distance profile at
    ``distance_alphas``; with ``window`` the attention budget (``budget_from_logits``, ``sinks``
    sinks). Visible keys must then be each row's first ``n``.
    """
    z = np.atleast_2d(np.asarray(logits, dtype=np.float64))  # (rows, n)
    rows = z.shape[0]
    finite = np.isfinite(z)
    n = finite.sum(axis=1)
    if np.any(n <= k_max):
        raise ValueError(f"every row needs more than k_max={k_max} visible keys")
    grid = np.asarray(alpha_grid, dtype=np.float64)
    top = -np.sort(np.where(finite, -z, np.inf), axis=1)[:, :k_max]
    zf = np.where(finite, z, 0.0)
    lse = logsumexp(np.where(finite[:, None, :], grid[None, :, None] * zf[:, None, :], -np.inf), axis=-1)
    w = np.where(finite, np.exp(z - logsumexp(z, axis=1, keepdims=True)), 0.0)
    mean = zf.sum(axis=1) / n
    var = np.where(finite, (zf - mean[:, None]) ** 2, 0.0).sum(axis=1) / n

    def col(v):
        return np.broadcast_to(np.asarray(v), (rows,)).copy()

    layer, head, seq = col(layer), col(head), col(seq)
    distance = None if edges is None else _distance_reference(z, finite, k_max, np.asarray(edges),
                                                             np.asarray(distance_alphas, dtype=np.float64),
                                                             layer, head, seq)
    budget = None if window is None else AttentionBudget(sinks=sinks, window=window,
                                                         share=budget_from_logits(z, window=window, sinks=sinks))
    return RowStats(n=n, layer=layer, head=head, seq=seq, top=top, alpha_grid=grid, lse=lse,
                    tilted_mean=np.sum(w * zf, axis=1), mean=mean, var=var, distance=distance, budget=budget)


def _distance_reference(z, finite, k_max, edges, alphas, layer, head, seq) -> DistanceStats:
    """``DistanceStats`` of whole rows, row by row in float64 (the definition in the module docstring)."""
    seqs, s_idx = np.unique(seq, return_inverse=True)
    shape = (seqs.size, int(layer.max()) + 1, int(head.max()) + 1)
    b, a = edges.size - 1, alphas.size
    out = dict(weight=np.zeros(shape + (b, a)), keys=np.zeros(shape + (b,)), sink=np.zeros(shape + (a,)),
               rows=np.zeros(shape))
    for r in range(z.shape[0]):
        n = int(finite[r].sum())
        if not finite[r, :n].all():
            raise ValueError("distance statistics need each row's visible keys first")
        row = z[r, :n]
        cell = (s_idx[r], layer[r], head[r])
        background = np.ones(n, bool)
        background[0] = False  # the sink
        background[np.argsort(-row, kind="stable")[:k_max]] = False  # the top set
        d = n - np.arange(n)  # distance of key j: own key 1, sink n
        bins = np.searchsorted(edges, d, side="right") - 1
        weights = np.exp(alphas[None, :] * (row - row.max())[:, None])  # (n, A)
        j = np.flatnonzero(background & (bins < b))
        np.add.at(out["weight"][cell], bins[j], weights[j])
        np.add.at(out["keys"][cell], bins[j], 1.0)
        out["sink"][cell] += weights[0] / weights.sum(axis=0)
        out["rows"][cell] += 1
    return DistanceStats(seq=seqs, alpha=alphas, edges=edges, **out)
