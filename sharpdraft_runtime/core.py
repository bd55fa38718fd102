"""Apply a scale spec to attention queries: ``q <- alpha(n) q`` with ``n`` the visible keys.

SharpDraft counters attention-mass dilution in a speculative-decoding drafter by multiplying each
query by a factor ``alpha(n)`` that grows with the number ``n`` of keys the query can see
(cardinality-aware query scaling; ``docs/theory.md``). Logits are linear in the query and RoPE is
a rotation, so scaling the post-RoPE query by ``alpha`` is exactly scaling the row's logits by
``alpha``::

    softmax(scaling * (alpha q) k^T) = softmax(alpha * scaling * q k^T)

The laws are the entries of :data:`sharpdraft_theory.laws.REGISTRY`: each formula is written once
against an array namespace, evaluated here with ``torch`` (the hot path never leaves the device)
and in :func:`sharpdraft_theory.alpha_law` with ``numpy`` (the float64 reference the tests hold it to).

Cost. Scaling is done in place (``query.mul_(alpha)``), so no query-sized tensor is allocated, and
it is skipped outright when every ``alpha`` is exactly 1, which :attr:`QueryScaler.identity_limit`
(the law's identity limit, :meth:`sharpdraft_theory.laws.Law.identity_limit`) decides on the host
from the key length alone (``n <= key length``). A decoding step of one sequence (one count, given
as an int or a one-element CPU tensor) takes its factor from :meth:`QueryScaler.host_alpha`, a few
Python operations in float64, and multiplies by that number: no kernel for alpha. A tabulated
law's knots live on the device (``laws.KnotTable``, compiled once per layer) and one
``torch.searchsorted`` finds each row's segment: a few more elementwise kernels than log-linear on the ``q_len``-sized ``n``, nothing
query-sized.

Autograd. In-place scaling is for inference (``torch.no_grad`` / ``torch.inference_mode``). When a
query requires grad and grad mode is on, :meth:`QueryScaler.scale_query_` scales out of place.
"""

from __future__ import annotations

import math

import torch
from sharpdraft_theory import ScaleSpec, get_law
from sharpdraft_theory.laws import ScalarNamespace

from .visible import causal_n_visible, mask_n_visible, visible_keys, window_overlay

__all__ = ["QueryScaler", "alpha_for", "scale_query_", "query_hook", "causal_n_visible", "mask_n_visible",
           "visible_keys", "flex_score_mod", "flex_mask_mod"]


class QueryScaler:
    """A scale spec compiled for one device: slopes or knot tables as tensors, the identity limit on the host.

    Parameters
    ----------
    spec : ScaleSpec
        The spec to apply. Per-layer and per-head specs need ``layer`` in every call.
    device : torch.device or str, optional
        Where the slope tensors live (that of the queries).
    dtype : torch.dtype, optional
        Precision of ``alpha`` (float32 by default; float64 for references). A query of lower
        precision is multiplied in this precision and rounded once.

    Examples
    --------
    >>> scaler = QueryScaler(ScaleSpec(law="log-linear", n_ref=512, slope=0.25, top_k=4), dtype=torch.float64)
    >>> scaler.alpha(torch.tensor([256, 512, 1024])).flatten().tolist()
    [1.0, 1.0, 1.1732867951399863]
    >>> scaler.identity_limit
    512
    """

    def __init__(self, spec: ScaleSpec, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.spec = spec
        self.device = torch.device(device)
        self.dtype = dtype
        self.law = get_law(spec.law)
        self.identity_limit = spec.identity_limit()  # largest n with alpha == 1 exactly (-1: none, inf: all)
        values = spec.values()
        # Per layer: slopes (), (heads, 1), or a table's values (knots,), (heads, 1, knots): a heads axis
        # before q_len broadcasts into (B, H, q_len). Compiled once here, so a call only indexes.
        self._per_layer = bool(spec.shape())  # per-layer or per-head parameters: calls need a layer
        layers = list(values) if self._per_layer else [values]
        if spec.granularity == "head":
            layers = [v[:, None] for v in layers]
        knots = None if spec.table is None else spec.table.n
        self._params = [self.law.compile(v, n_ref=spec.n_ref, knots=knots, asarray=self._tensor) for v in layers]
        # The same parameters as Python numbers, for one count on the host (a decoding step); not per head.
        self._host_params = None if spec.granularity == "head" else [
            self.law.compile(v, n_ref=spec.n_ref, knots=knots, asarray=ScalarNamespace.asarray) for v in layers]

    def _tensor(self, array):
        """A numpy array on the device: floats in ``self.dtype``, integers as they are."""
        return torch.as_tensor(array, dtype=self.dtype if array.dtype.kind == "f" else None, device=self.device)

    def param(self, layer: int | None):
        """The law's compiled parameter for ``layer`` (see ``Law.compile``): a slope of shape () or
        (heads, 1), a ``KnotTable``, or None for ``qwen-logn``."""
        if not self._per_layer:
            return self._params[0]
        if layer is None:
            raise ValueError(f"this spec has {self.spec.granularity} parameters: pass layer=")
        if not 0 <= layer < len(self._params):
            raise ValueError(f"layer {layer} is out of range: the spec has {len(self._params)} layers")
        return self._params[layer]

    def alpha(self, n_visible: torch.Tensor | int, layer: int | None = None) -> torch.Tensor:
        """Query factors for visible-key counts.

        Parameters
        ----------
        n_visible : Tensor of shape (q_len,), (batch, q_len) or (batch, 1 or heads, q_len), or int
            Keys each query row sees.
        layer : int, optional
            Layer index (needed by per-layer and per-head specs).

        Returns
        -------
        Tensor of shape (batch or 1, heads or 1, q_len), in ``self.dtype``
            Broadcasts into a query of shape (batch, heads, q_len, head_dim) once given a trailing
            axis. A per-head spec makes the heads axis full; an int ``n_visible`` gives (1, 1 or heads, 1).
        """
        param = self.param(layer)
        n = torch.as_tensor(n_visible, device=self.device).to(self.dtype)
        if n.ndim > 3:
            raise ValueError(f"n_visible must have shape (q_len,), (batch, q_len) or (batch, heads, q_len), "
                             f"got {tuple(n.shape)}")
        n = n.reshape(1, 1, -1) if n.ndim < 2 else n[:, None, :] if n.ndim == 2 else n  # (B|1, H|1, q_len)
        return self.law.alpha(torch, n, n_ref=self.spec.n_ref, param=param, alpha_max=self.spec.alpha_max)

    def host_alpha(self, n: int, layer: int | None = None) -> float:
        """``alpha(n)`` for one count, in float64 on the host (a few Python operations, no kernel).

        Not for a per-head spec (a ``ValueError``: its factors differ by head, use :meth:`alpha`).

        >>> QueryScaler(ScaleSpec(law="log-linear", n_ref=512, slope=0.25, top_k=4)).host_alpha(1024)
        1.1732867951399863
        """
        if self._host_params is None:
            raise ValueError("this spec has per-head parameters: its alpha is a tensor (QueryScaler.alpha)")
        param = self._host_params[0]
        if self._per_layer:
            self.param(layer)  # names a missing or out-of-range layer
            param = self._host_params[layer]
        return self.law.alpha(ScalarNamespace, float(n), n_ref=self.spec.n_ref, param=param,
                              alpha_max=self.spec.alpha_max)

    def scale_query_(self, query: torch.Tensor, n_visible: torch.Tensor | int, layer: int | None = None) -> torch.Tensor:
        """Multiply ``query`` by ``alpha(n_visible)`` in place (out of place when autograd needs it).

        Parameters
        ----------
        query : Tensor of shape (batch, heads, q_len, head_dim)
            Post-RoPE queries; for GQA the query heads (not the key/value heads).
        n_visible : Tensor of shape (q_len,), (batch, q_len) or (batch, 1 or heads, q_len), or int
            Keys each query row sees (see :func:`causal_n_visible`, :func:`mask_n_visible`).
        layer : int, optional
            Layer index (needed by per-layer and per-head specs).

        Returns
        -------
        Tensor of shape (batch, heads, q_len, head_dim)
            ``query`` itself, scaled; a new tensor only when autograd needs the original.
        """
        if self.identity_limit == math.inf:
            return query  # nothing to scale (a spec that only fixes distances or keys has alpha 1 everywhere)
        if isinstance(n_visible, torch.Tensor) and n_visible.numel() == 1 and n_visible.device.type == "cpu":
            n_visible = int(n_visible)  # one row of one sequence (a decoding step): its count read for free
        if isinstance(n_visible, int):
            if n_visible <= self.identity_limit:
                return query
            if self._host_params is not None:  # one factor for the whole query, computed on the host
                return self.multiply_(query, self.host_alpha(n_visible, layer))
        return self.multiply_(query, self.alpha(n_visible, layer)[..., None])

    @staticmethod
    def multiply_(query: torch.Tensor, alpha: torch.Tensor | float) -> torch.Tensor:
        """``query`` (B, H, q_len, D) times ``alpha`` (B|1, H|1, q_len, 1, or one float): in place, unless autograd
        needs ``query``."""
        if query.requires_grad and torch.is_grad_enabled():
            return query * alpha
        return query.mul_(alpha)


def _scaler(spec: ScaleSpec | QueryScaler, device, dtype=torch.float32) -> QueryScaler:
    return spec if isinstance(spec, QueryScaler) else QueryScaler(spec, device, dtype)


def alpha_for(spec: ScaleSpec | QueryScaler, n_visible: torch.Tensor | int, layer: int | None = None, *,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Query factors ``alpha(n)`` for a tensor of visible-key counts (see :meth:`QueryScaler.alpha`).

    Parameters
    ----------
    spec : ScaleSpec or QueryScaler
        The spec (a :class:`QueryScaler` skips compiling it again; ``dtype`` is then its own).
    n_visible : Tensor of shape (q_len,), (batch, q_len) or (batch, 1 or heads, q_len), or int
        Keys each query row sees.
    layer : int, optional
        Layer index (needed by per-layer and per-head specs).
    dtype : torch.dtype, optional
        Precision of the result.

    Returns
    -------
    Tensor of shape (batch or 1, heads or 1, q_len)

    Examples
    --------
    >>> spec = ScaleSpec(law="log-linear", n_ref=4, slope=((0.0, 1.0),), granularity="head", top_k=1)
    >>> alpha_for(spec, torch.tensor([4, 8]), layer=0, dtype=torch.float64)[0].tolist()
    [[1.0, 1.0], [1.0, 1.6931471805599454]]
    """
    device = n_visible.device if isinstance(n_visible, torch.Tensor) else "cpu"
    return _scaler(spec, device, dtype).alpha(n_visible, layer)


def scale_query_(query: torch.Tensor, n_visible: torch.Tensor | int, spec: ScaleSpec | QueryScaler,
                 layer: int | None = None) -> torch.Tensor:
    """Scale ``query`` of shape (batch, heads, q_len, head_dim) by ``alpha(n_visible)`` in place.

    See :meth:`QueryScaler.scale_query_`; build a :class:`QueryScaler` once when calling per layer.
    Returns ``query`` (a new tensor only when autograd needs the original).
    """
    return _scaler(spec, query.device).scale_query_(query, n_visible, layer)


def query_hook(spec: ScaleSpec | QueryScaler):
    """A ``hook(layer_idx, query, key, scaling, n_visible)`` that scales ``query`` in place.

    For attention code with that hook point, such as calibrate's EAGLE-3 head
    (``Eagle3Model.forward(..., attention_hook=query_hook(spec))``): ``query`` (batch, heads, q_len,
    head_dim) post-RoPE, ``key`` (batch, kv_heads, k_len, head_dim), ``n_visible`` (batch, q_len).
    Returns the scaled query (the same tensor under no-grad / inference mode).
    """
    scalers = {}

    def hook(layer_idx, query, key, scaling, n_visible):
        if query.device not in scalers:
            scalers[query.device] = _scaler(spec, query.device)
        return scalers[query.device].scale_query_(query, n_visible, layer_idx)

    return hook


def flex_score_mod(spec: ScaleSpec | QueryScaler, n_visible: torch.Tensor | int, layer: int | None = None):
    """A FlexAttention ``score_mod`` that multiplies each logit by its row's ``alpha``.

    Parameters
    ----------
    spec : ScaleSpec or QueryScaler
        The spec to apply.
    n_visible : Tensor of shape (q_len,), (batch, q_len) or (batch, 1 or heads, q_len), or int
        Keys each query row sees (FlexAttention's ``score`` already includes the ``scaling``).
    layer : int, optional
        Layer index (needed by per-layer and per-head specs).

    Returns
    -------
    callable ``score_mod(score, b, h, q_idx, kv_idx) -> score * alpha[b, h, q_idx]``
        For ``torch.nn.attention.flex_attention.flex_attention(query, key, value, score_mod=...)``.
        Use it in place of :func:`scale_query_` (not with it) where a fused kernel is wanted.
    """
    device = n_visible.device if isinstance(n_visible, torch.Tensor) else "cpu"
    alpha = _scaler(spec, device).alpha(n_visible, layer)  # (B|1, H|1, q_len|1)
    whole_batch, per_head, per_row = (size > 1 for size in alpha.shape)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score * alpha[b if whole_batch else 0, h if per_head else 0, q_idx if per_row else 0]

    return score_mod


def flex_mask_mod(spec: ScaleSpec, past: int = 0, first: torch.Tensor | None = None):
    """A FlexAttention ``mask_mod`` for causal queries after ``past`` cached keys, with the spec's window and sinks.

    Parameters
    ----------
    spec : ScaleSpec
        Its ``window`` and ``sinks`` (none: plain causal attention) are applied by
        :func:`~sharpdraft_runtime.visible.window_overlay`, the rule the transformers binding uses.
    past : int
        Keys before the first query (query ``q_idx`` sits at position ``past + q_idx``).
    first : Tensor of shape (batch,), optional
        Each sequence's first real key (left padding; sinks count from it). Padding itself is
        not masked here: and it in with the caller's own mask_mod.

    Returns
    -------
    callable ``mask_mod(b, h, q_idx, kv_idx) -> bool``
        For ``create_block_mask(mask_mod, B, H, q_len, k_len)`` and ``flex_attention(..., block_mask=...)``,
        beside :func:`flex_score_mod` (whose ``n_visible`` is then :func:`causal_n_visible` with the
        same window and sinks).
    """
    overlay = None if not spec.restricts() else window_overlay(spec.window, spec.sinks, first)

    def mask_mod(b, h, q_idx, kv_idx):
        causal = kv_idx <= q_idx + past
        return causal if overlay is None else causal & overlay(b, h, q_idx + past, kv_idx)

    return mask_mod
